"""bench/soak.py against a real server process on the demo model (CPU): streaming clients that disconnect at
random and bad requests mixed in; the server must report no errors and get every KV block back once idle.
(The 10-minute, 256-client run is the GPU benchmark; this checks the script and the same invariants briefly.)"""
import json
import subprocess
import sys

from conftest import REPO
from server_common import free_port


def test_soak_script_short_run_passes(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(REPO / "bench" / "soak.py"), "--duration", "6", "--concurrency", "6",
           "--sample-every", "2", "--max-prompt", "96", "--max-output", "24", "--vocab", "2000", "--seed", "3",
           "--bad-share", "0.2", "--disconnect-share", "0.4",
           "--port", str(free_port()), "--server-log", str(tmp_path / "server.log"), "--out", str(out),
           "--", "--device", "cpu", "--max-num-seqs", "4"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert out.is_file(), proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert proc.returncode == 0 and summary["passed"], (summary, report["error_samples"])
    assert summary["completed"] > 0 and summary["all_kv_blocks_back"] and summary["server_errors_5xx"] == 0
    assert summary["kv_blocks_free_at_end"] == summary["kv_blocks_total"]
    assert all(s["status"] == "ok" for s in report["timeline"])
    assert summary["disconnected"] > 0 and summary["bad_rejected_4xx"] > 0, summary
