// One comm thread per HookState: runs posted jobs in FIFO order, so every
// rank issues its collectives in the order the hook was called, and the hook
// returns at once while backward keeps computing.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace hetcomm {

class Worker {
 public:
  Worker();
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Jobs must not throw (they report their own errors).
  void post(std::function<void()> job);
  // Blocks until every job posted so far has run.
  void drain();
  // Runs what is queued, then stops the thread. Idempotent. Returns whether
  // the thread has ended (false when called from the thread itself).
  bool close();
  bool closed() const;

 private:
  void loop();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  bool busy_ = false;
  std::thread thread_;
};

}  // namespace hetcomm
