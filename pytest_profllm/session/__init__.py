"""The pytest session's side: suites as collectors, xdist scheduling, the worker that runs
cases, the controller that writes records, the terminal report, SIGTERM."""
