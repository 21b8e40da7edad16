"""Helpers shared by tests of several packages, one job each:

- waiting: `eventually` / `eventually_async`, the one way to wait for a condition;
- processes: child processes in a group of their own, killed with it even on failure, and the
  /proc probes that prove a process gone; worker_child is the peer process they start;
- admin: a JSON POST to the admin API from a blocking test body;
- serving: proof that a server still serves after hostile input;
- netns: a cluster whose nodes are hosts of their own (network namespaces);
- train_cli: `shoal train` in a child process, its JSON summary read back;
- signal_room, odd_envs, hostile_lm, sequences: environments, models and fragments that tests
  train on or attack with;
- chaos_report: what a failed `shoal chaos run --json` is shown as."""
