"""The outputs of report, eval and quantize go through storage.py: a URL as --out writes
the same bytes to the bucket as a local path writes to disk."""

import json

from jaxtrain import storage
from jaxtrain.commands import report


def test_a_report_png_to_a_bucket_is_the_local_png(bucket, tmp_path):
    rows = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 1000.0, "step_time_s": 0.1,
             "mfu": 0.01} for s in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report.main(["--workdir", str(tmp_path), "--out", str(tmp_path / "here" / "r.png")])
    report.main(["--workdir", str(tmp_path), "--out", f"{bucket}/plots/r.png"])
    local = (tmp_path / "here" / "r.png").read_bytes()
    assert local.startswith(b"\x89PNG")
    assert storage.as_path(f"{bucket}/plots/r.png").read_bytes() == local
