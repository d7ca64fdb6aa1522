"""Several commands of the toy CLI (`python -m ddpkit.toy ARGS`) in one interpreter, one after another, for
test_bad_input.py: each one's exit status and output (file descriptors 1 and 2, so that what Lightning's
logging handlers write is there too), without paying torch's and Lightning's import once per command.

    python one_interpreter.py CASES.json

CASES.json: a list of {"args": [...], "cwd": folder, "gpus": GPUs torch.cuda reports or null for this
machine's, "env": variables set for the command, "out": file}. Each command's output goes to its "out" file,
and its exit status is the file's last line once it has ended: a command that takes the interpreter down (one
that should have stopped but launched ranks) leaves the others' results as they were.
"""

import json
import os
import sys
import traceback

if os.environ.get("LOCAL_RANK", "0") != "0":  # a rank launched by a command that should have stopped: stop
    sys.exit(3)

import torch  # noqa: E402  (after the guard: a stray rank imports nothing)

from ddpkit.testing import fake_cuda  # noqa: E402
from ddpkit.testing.toy import main  # noqa: E402


def run(case: dict) -> None:
    real = torch.cuda.is_available, torch.cuda.device_count
    if case["gpus"] is not None:  # what procs.FAKE_CUDA does at a launch's start-up
        os.environ["FAKE_CUDA_DEVICES"] = str(case["gpus"])
        fake_cuda.install()
    os.environ.update(case["env"])
    os.chdir(case["cwd"])
    with open(case["out"], "w") as out:  # outside cwd: a test checks that the command writes nothing there
        sys.stdout.flush(), sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1), os.dup2(out.fileno(), 2)
        try:
            main(case["args"])
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1  # as the interpreter exits on an uncaught exception
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
            torch.cuda.is_available, torch.cuda.device_count = real
            os.environ.pop("FAKE_CUDA_DEVICES", None)
        out.write(f"\nexit status {code}\n")


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    for case in cases:
        run(case)
