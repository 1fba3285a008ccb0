#include "engine/worker.h"

#include <ATen/Parallel.h>

#include <pthread.h>
#include <unistd.h>

#include <stdexcept>
#include <string>

namespace hetcomm {

namespace {

void refuse_in_child(pid_t owner) {
  throw std::runtime_error(
      "hetcomm: this HookState's comm thread runs in process " + std::to_string(owner) +
      "; this process (" + std::to_string(getpid()) +
      ") was forked from it (a DataLoader worker, os.fork) and has no such thread, so it cannot reduce through it: "
      "train in the process that made the HookState, or make a HookState (and DDP model) in the child");
}

}  // namespace

Worker::Worker() : owner_(getpid()), thread_([this] { loop(); }) {}

Worker::~Worker() { close(); }

bool Worker::forked() const { return getpid() != owner_; }

void Worker::post(std::function<void()> job) {
  if (forked()) refuse_in_child(owner_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) throw std::runtime_error("hetcomm: the comm worker is closed (HookState.close() was called)");
    queue_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void Worker::drain() {
  if (forked()) refuse_in_child(owner_);
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [this] { return queue_.empty() && !busy_; });
}

bool Worker::close() {
  if (forked()) return false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable() && std::this_thread::get_id() != thread_.get_id()) thread_.join();
  return !thread_.joinable();
}

bool Worker::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stop_;
}

void Worker::loop() {
  // A name for top -H, py-spy and /proc/PID/task/*/comm (at most 15 characters),
  // so a profile tells this thread's CPU from the trainer's and gloo's.
#ifdef __linux__
  pthread_setname_np(pthread_self(), kThreadName);
#endif
  // Take the intra-op thread count set by torch.set_num_threads.
  at::init_num_threads();
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) {
        idle_cv_.notify_all();
        return;
      }
      job = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    job();
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
    }
    idle_cv_.notify_all();
  }
}

}  // namespace hetcomm
