#include "train/interrupt.h"

#include "core/log.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

#include "core/error.h"

namespace ds {

namespace {

volatile sig_atomic_t g_signal = 0;
volatile sig_atomic_t g_quiet = 0;  // the first signal's line is not printed (log_muted() at construction)
// The message a second signal prints, in two buffers: the trainer fills the one not in use, then publishes it
// (g_message), so the handler never reads a half-written one.
constexpr size_t kMessageBytes = 4096;
char g_messages[2][kMessageBytes];
std::atomic<int> g_message{-1};
struct sigaction g_old_int, g_old_term, g_old_usr1;

// Async-signal-safe: only write(2), _exit(2) and the flag.
void on_signal(int sig) {
  if (g_signal == 0) {
    g_signal = sig;
    const char* m = sig == SIGINT    ? "\n[deltastack] SIGINT: finishing the current step, then saving a checkpoint "
                                       "(a second signal stops at once)\n"
                    : sig == SIGUSR1 ? "\n[deltastack] SIGUSR1: finishing the current step, then saving a checkpoint "
                                       "(a second signal stops at once)\n"
                                     : "\n[deltastack] SIGTERM: finishing the current step, then saving a checkpoint "
                                       "(a second signal stops at once)\n";
    if (!g_quiet) write_stderr_in_signal_handler(m);  // ranks other than 0 of a multi-rank run say nothing
    return;
  }
  const int i = g_message.load();
  const char* m = i >= 0 ? g_messages[i]
                         : "[deltastack] second signal: stopping now; this run has saved no checkpoint yet\n";
  write_stderr_in_signal_handler(m);
  ::_exit(128 + sig);
}

}  // namespace

InterruptGuard::InterruptGuard() {
  g_signal = 0;
  g_quiet = log_muted() ? 1 : 0;
  g_message = -1;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  // SIGUSR1 too: Open MPI's mpirun turns a SIGINT / SIGTERM into SIGTERM to every rank and SIGKILL one second
  // later (odls_base_sigkill_timeout), too soon for a step and a save, but forwards SIGUSR1 as it is.
  DS_CHECK(::sigaction(SIGINT, &sa, &g_old_int) == 0 && ::sigaction(SIGTERM, &sa, &g_old_term) == 0 &&
               ::sigaction(SIGUSR1, &sa, &g_old_usr1) == 0,
           "cannot install the SIGINT / SIGTERM / SIGUSR1 handlers");
}

InterruptGuard::~InterruptGuard() {
  ::sigaction(SIGINT, &g_old_int, nullptr);
  ::sigaction(SIGTERM, &g_old_term, nullptr);
  ::sigaction(SIGUSR1, &g_old_usr1, nullptr);
}

int InterruptGuard::signal() const { return g_signal; }

void InterruptGuard::set_last_checkpoint(const std::string& path) {
  const int next = g_message.load() == 0 ? 1 : 0;
  const std::string m = "[deltastack] second signal: stopping now; the last complete checkpoint is " + path +
                        " (resume: deltastack train --resume " + path + ")\n";
  std::strncpy(g_messages[next], m.c_str(), kMessageBytes - 1);
  g_messages[next][kMessageBytes - 1] = '\0';
  g_message.store(next);
}

std::string signal_name(int sig) {
  if (sig == SIGINT) return "SIGINT";
  if (sig == SIGTERM) return "SIGTERM";
  if (sig == SIGUSR1) return "SIGUSR1";
  return "signal " + std::to_string(sig);
}

}  // namespace ds
