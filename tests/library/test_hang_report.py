"""The hang report's reading of the dumps (ddpkit/run/hang.py), on dumps written by hand; the real hangs, on 2
processes: test_faults.py."""

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from ddpkit.run import hang
from ddpkit.run.hang import Collective, Frame, RankDump

TORCH = str(Path(torch.__file__).parent.resolve())
USER = "/project/src/model.py"


def write(directory: Path, rank: int, timed_out: bool, seq: int, stack: list[Frame]) -> None:
    dump = RankDump(rank, "node0", 100 + rank, timed_out, "Timed out" if timed_out else "", stack,
                    [Collective(seq - 1, "gloo:broadcast", "0"), Collective(seq, "gloo:all_reduce", "0")])  # fmt: skip
    (directory / f"rank{rank}.json").write_text(json.dumps(asdict(dump)))


def test_report_names_the_rank_behind_its_line_and_a_rank_without_dump(tmp_path):
    """Of 3 ranks, rank 1 (2 collectives behind rank 0, which timed out) is named with its innermost frame of
    the run's own code, past torch's frames; rank 0 with its innermost frame (no own code on its stack); rank 2,
    which left no dump, with its host."""
    entry = Frame(hang.ENTRY[0], 10, "run_subcommand", "")
    write(tmp_path, 0, True, 9, [entry, Frame(f"{TORCH}/autograd/graph.py", 5, "_engine_run_backward", "")])
    write(tmp_path, 1, False, 7, [entry, Frame(USER, 42, "training_step", "x = next(it)"),
                                  Frame(f"{TORCH}/utils/data/dataloader.py", 3, "__next__", "")])  # fmt: skip
    text = hang.report(tmp_path, 3, {2: ("node1", 7)})
    assert (
        "rank 1 was behind: it never started collective #9 gloo:all_reduce, which rank 0 waits in; "
        f"it was at {USER}:42 in training_step: x = next(it)\n"
    ) in text, text
    assert f"  rank 0: waits in collective #9 gloo:all_reduce (Timed out); at {TORCH}/autograd/graph.py:5" in text
    assert "  rank 2: no dump (on node1, or blocked outside Python)\n" in text
    assert text.count("was behind") == 1


@pytest.mark.parametrize("records", [True, False], ids=["recorder-off", "torch-before-2.8"])
def test_a_dump_without_collectives_says_why(tmp_path, monkeypatch, records):
    """A rank whose dump holds no collectives is reported with the reason: the flight recorder was switched off, or
    this torch (named) records none for gloo, as before 2.8."""
    monkeypatch.setattr(hang, "records_gloo_collectives", lambda: records)
    dump = RankDump(0, "node0", 100, True, "Timed out", [Frame(USER, 42, "training_step", "x = next(it)")], [])
    (tmp_path / "rank0.json").write_text(json.dumps(asdict(dump)))
    before_2_8 = f"torch {torch.__version__} does not record gloo's collectives; 2.8 and later do"
    why = "TORCH_FR_BUFFER_SIZE=0?" if records else before_2_8
    text = hang.report(tmp_path, 1)
    assert f"  rank 0: no collective recorded ({why}); at {USER}:42 in training_step: x = next(it)\n" in text, text


SIGTERM_AFTER_DUMP = """
import os, signal, sys, time
from pathlib import Path
from ddpkit.run import hang
from ddpkit.run.stop import GracefulStop

hang.arm(Path(sys.argv[1]), 0, 1)
signal.signal(signal.SIGTERM, GracefulStop()._request)  # as in training
os.kill(os.getpid(), hang.SIGNAL)  # another rank timed out and asks for this one's dump
os.kill(os.getpid(), signal.SIGTERM)  # torchrun's agent stops the survivors
time.sleep(5)
print("still running")
"""


def test_sigterm_after_a_hang_dump_exits_at_once(tmp_path):
    """A rank that dumped for a hang exits on SIGTERM (143) instead of waiting for a step that never ends (under
    torchrun the agent would SIGKILL it 30 s later), having written its dump."""
    result = subprocess.run([sys.executable, "-c", SIGTERM_AFTER_DUMP, str(tmp_path)], capture_output=True,
                            text=True, timeout=120, check=False)  # fmt: skip
    assert result.returncode == 143 and "still running" not in result.stdout, result.stderr[-2000:]
    assert "rank 0: after the hang report, SIGTERM, exiting now" in result.stderr
    asked = next(n for n, line in enumerate(SIGTERM_AFTER_DUMP.splitlines(), 1) if "hang.SIGNAL" in line)
    assert RankDump.load(tmp_path / "rank0.json").stack[-1].line == asked  # where the main thread was
