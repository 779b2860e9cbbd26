"""The quiet terminal: ranks mark their lines (job/console.py), `dsforge run` shows only those
(launch/output.py) and keeps everything in the job log (launch/local.py)."""

from __future__ import annotations

import io
import sys

from dsforge.job.console import MARK, RankConsole, parse
from dsforge.launch.local import run_job
from dsforge.launch.output import JobView


def test_marked_lines_survive_a_pdsh_prefix_and_others_are_not_marked():
    line = "worker-3: " + MARK + '{"kind": "line", "text": "hello"}'
    assert parse(line) == {"kind": "line", "text": "hello"}
    assert parse("[2026-11-22 10:00:00,000] [INFO] [launch.py:1:main] cmd = ... --job AAAA") is None
    assert parse(MARK + "{not json") is None and parse(MARK + '{"no": "kind"}') is None


def test_view_shows_dsforge_lines_and_progress_only():
    out = io.StringIO()
    view = JobView(out=out)
    view.feed("[INFO] [runner.py] cmd = python -m dsforge.runtime.rank --job QUJD")
    view.feed(MARK + '{"kind": "line", "text": "dsforge: hello"}')
    for step in (1, 2):
        view.feed(MARK + f'{{"kind": "progress", "name": "x", "step": {step}, "steps": 2, "postfix": "loss {step}"}}')
    view.feed(MARK + '{"kind": "line", "text": "done: 2 steps"}')
    view.close()
    text = out.getvalue()
    assert "dsforge: hello" in text and "done: 2 steps" in text and "2/2" in text
    assert "INFO" not in text and "--job" not in text
    assert view.lines_shown == ["dsforge: hello", "done: 2 steps"]


def test_progress_to_a_file_is_a_line_every_tenth_of_the_steps_not_a_redrawn_bar():
    """A terminal that is a file or a pipe (a batch job's log, `2> run.log`) gets lines, not
    tqdm's carriage-return frames (52 KB of them for the 200-step smoke run)."""
    out = io.StringIO()
    view = JobView(out=out)
    for step in range(1, 21):
        view.feed(MARK + f'{{"kind": "progress", "name": "x", "step": {step}, "steps": 20, "postfix": "loss {step}"}}')
    view.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0] == "x: step 1/20, loss 1" and lines[-1] == "x: step 20/20, loss 20"
    assert len(lines) == 11  # steps 1, 3, ..., 19 and the last


def test_verbose_view_shows_everything():
    out = io.StringIO()
    view = JobView(verbose=True, out=out)
    view.feed("[INFO] engine says hi")
    assert "engine says hi" in out.getvalue()


def test_run_job_logs_everything_and_hands_over_lines(tmp_path):
    script = ("import sys\n"
              "print('engine noise')\n"
              f"print({MARK!r} + '{{\"kind\": \"line\", \"text\": \"mine\"}}')\n"
              "sys.stderr.write('progress 1\\rprogress 2\\n')\n")
    seen = []
    code = run_job([sys.executable, "-c", script], log_path=tmp_path / "job.log", on_line=seen.append)
    assert code == 0
    assert "engine noise" in (tmp_path / "job.log").read_text()
    assert seen[0] == "engine noise" and parse(seen[1])["text"] == "mine"
    assert seen[2:] == ["progress 1", "progress 2"]


def test_plain_rank_console_prints_text(capsys):
    console = RankConsole(marked=False)
    console.say("dsforge: plain")
    assert capsys.readouterr().err == "dsforge: plain\n"


def test_what_every_rank_says_is_shown_once():
    """Eight ranks failing the same build make one line and one that names the others."""
    out = io.StringIO()
    view = JobView(out=out)
    for rank in range(8):
        view.feed(MARK + f'{{"kind": "line", "text": "dsforge: rank {rank} failed building '
                         f'fused_adam before its first step: TORCH_CUDA_ARCH_LIST"}}')
    view.feed(MARK + '{"kind": "line", "text": "dsforge: rank 2 ran out of memory at step 3"}')
    view.close()
    assert view.lines_shown == [
        "dsforge: rank 0 failed building fused_adam before its first step: TORCH_CUDA_ARCH_LIST",
        "dsforge: rank 2 ran out of memory at step 3",
        "dsforge: ranks 1, 2, 3, 4, 5, 6, 7 said the same: failed building fused_adam before its "
        "first step: TORCH_CUDA_ARCH_LIST",
    ]
