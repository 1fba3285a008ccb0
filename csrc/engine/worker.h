// One comm thread per HookState: runs posted jobs in FIFO order, so every
// rank issues its collectives in the order the hook was called, and the hook
// returns at once while backward keeps computing.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include <sys/types.h>

namespace hetcomm {

class Worker {
 public:
  static constexpr const char* kThreadName = "hetcomm_comm";

  Worker();
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Jobs must not throw (they report their own errors). In a forked child:
  // a std::runtime_error (the thread stayed in the parent).
  void post(std::function<void()> job);
  // Blocks until every job posted so far has run. In a forked child: as post.
  void drain();
  // Runs what is queued, then stops the thread. Idempotent. Returns whether
  // the thread has ended (false when called from the thread itself, and in a
  // forked child, where it does nothing).
  bool close();
  bool closed() const;
  // Whether this process is a child forked from the one that made the thread
  // (a DataLoader worker, os.fork): the thread did not come along, and the
  // mutex and condition variables may be held or waited on by it forever.
  bool forked() const;

 private:
  void loop();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  bool busy_ = false;
  const pid_t owner_;  // the process whose thread this is
  std::thread thread_;
};

}  // namespace hetcomm
