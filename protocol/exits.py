"""A worker process's exit codes: what it says by ending, as the supervisor reads them.

The worker (worker/__main__.py, worker/group/rank.py) exits with these; the supervisor
turns them into an `ExitCause` (supervisor/workers/states.py `exit_verdict`). 0 is a
cooperative shutdown (Shutdown or SIGTERM); any other code is a crash, and a signal
(negative) a kill.
"""

EXIT_LOAD_FAILED = 3   # the model cannot be loaded (an Error without a rid said why)
EXIT_BROKEN = 4        # MLX cannot run a step after a failed request: replace this worker
EXIT_GROUP_LOST = 5    # a worker group lost a rank (or its link): the group is replaced
