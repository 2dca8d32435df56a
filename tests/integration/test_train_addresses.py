"""`polar train` with its services on different addresses, as on several machines: the rollout
server on 127.0.0.1, the inference server on 127.0.0.2, Envoy and the gateway node on 127.0.0.3, the
trainer's /metrics on 127.0.0.4. Nothing may assume 127.0.0.1: Envoy learns the inference server and
the gateway at the addresses they advertise, and the run trains its steps. The trainer's /metrics is
scraped while it trains."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.train_runs import start_train, write_run
from trainer.metrics import read_metrics

pytestmark = pytest.mark.slow

STEPS = 2
HOSTS = {"rollout": "127.0.0.1", "inference": "127.0.0.2", "envoy": "127.0.0.3", "gateway": "127.0.0.3"}


def on_addresses(config: Path) -> None:
    text = config.read_text()
    for section, host in HOSTS.items():
        text = text.replace(f"[{section}]\n", f'[{section}]\nhost = "{host}"\n', 1)
    config.write_text(text.replace("[trainer]\n", '[trainer]\nmetrics_address = "127.0.0.4:0"\n', 1))


def trainer_samples(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name + ("" if not sample.labels else str(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_polar_train_with_each_service_on_its_own_address(tmp_path: Path) -> None:
    config = write_run(tmp_path, STEPS, groups_per_step=1)
    on_addresses(config)
    run_dir = tmp_path / "run"
    process, lines = start_train(config, run_dir)
    try:
        # Each service's ready line, then the endpoint table.
        metrics = lines.wait_for(r"^trainer: .*metrics (http://127\.0\.0\.4:\d+/metrics)", timeout=300).group(1)
        for name in ("rollout", "inference", "node"):
            lines.wait_for(rf"^  {name} +{re.escape(HOSTS.get(name, HOSTS['gateway']))}:\d+ ", timeout=60)
        lines.wait_for(r"train: .*step 1/2", timeout=300)
        deadline = time.monotonic() + 60
        while (samples := trainer_samples(metrics))["polar_trainer_step"] < 1:
            assert time.monotonic() < deadline, "the trainer's /metrics never showed a step"
            time.sleep(0.5)
        assert samples["polar_trainer_policy_version"] >= 1 and samples["polar_trainer_trained_tokens_total"] > 0
        assert samples["polar_trainer_last[('metric', 'step')]"] >= 1
        lines.wait_for(rf"train: done: {STEPS} steps", timeout=300)
        assert process.wait(timeout=120) == 0
    finally:
        process.kill()
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert [row["policy_version"] for row in rows] == list(range(1, STEPS + 1))
