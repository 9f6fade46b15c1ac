"""scripts/gpu_check.py in its --smoke mode: tiny shapes on the CPU, with only what the GPU machine has.

The script is the one prepared device check (README, GPU section); running it here on every test run keeps it
from rotting between the rare sessions that have a GPU. Ray, vLLM, pydantic and transformers are hidden from
it, as they may be absent there (the models are built on the spot; no files are read).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = ("ray", "vllm", "pydantic", "transformers")
LAUNCH = ("import runpy, sys; "
          f"sys.modules.update(dict.fromkeys({HIDDEN!r})); "  # None in sys.modules: the import fails
          "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def test_smoke_run_writes_every_section_and_passes_the_identity_check(tmp_path):
    out = tmp_path / "smoke.json"
    run = subprocess.run([sys.executable, "-c", LAUNCH, str(ROOT / "scripts" / "gpu_check.py"), "--smoke",
                          "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] is True
    sections = report["sections"]
    assert set(sections) == {"copy_bandwidth", "attention", "decode", "verify_cost", "greedy_identity",
                             "verifiers", "decode_variants"}
    assert not [name for name, s in sections.items() if "error" in s]
    assert sections["greedy_identity"]["float32"] == {**sections["greedy_identity"]["float32"],
                                                      "identical": True, "alpha": 1.0}
    assert sorted(sections["verify_cost"]["b1"]["v"]) == [str(g) for g in range(1, 9)]
    assert {"b1", "b8", "b32", "b1_through_host"} <= set(sections["decode"])
    assert report["goals"]["greedy_identity_fp32_alpha_1"] is True
