"""bench/publish.py's code path at a tiny size: two real workers on one registry and a router,
versions published from memory with waits, then more under traffic at keep 3. Its outcome checks
(no timing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import publish  # noqa: E402


def test_the_publish_benchmark_runs_at_a_tiny_size(tmp_path):
    out = tmp_path / "publish.json"
    assert publish.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    latency, steady = result["latency"], result["steady"]
    assert latency["publishes"] == 3 and latency["all_ready"]
    assert set(latency["shares"]) == {"upload", "register", "load", "rest"}
    assert steady["publishes"] == 5 and steady["keep"] == 3
    assert steady["answers"] > 0 and steady["wrong"] == 0 and steady["failed"] == 0
    assert steady["not_ready"] == 0
    # 3 + 5 revisions of the name: the newest 3 kept, the rest retired, their artifacts collected
    assert steady["registry_revisions"] == 8 and steady["registry_not_retired"] == 3
    assert steady["registry_retired"] == steady["retire_events"] == 5
    assert steady["retired_as_set"] and steady["store_max_artifacts_of_name"] <= 3
    assert steady["held_max_bytes"] <= 3 * steady["revision_host_bytes"]
    assert [row["revision"] for row in result["rows"]] == ["r1", "r2", "r3"]
