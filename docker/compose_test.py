"""Runs docker/docker-compose.yml with the dpex:test image, kills worker2 in
the middle of the first epoch, and checks that every batch arrived exactly
once and in order, each sample read by a worker from its own volume."""
import json
import os
import secrets
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dpex.testing.nodes import check  # noqa: E402

SAMPLES = 400
HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "DPEX_IMAGE": "dpex:test", "DPEX_SAMPLES": str(SAMPLES), "COMPOSE_PROJECT_NAME": "dpextest",
       "DPEX_AUTH_TOKEN": secrets.token_hex(16)}
COMPOSE = ["docker-compose", "-f", os.path.join(HERE, "docker-compose.yml")]


def compose(*args, **kwargs):
    return subprocess.run([*COMPOSE, *args], env=ENV, check=True, **kwargs)


def main() -> None:
    try:
        compose("up", "-d", "dispatcher", "worker1", "worker2", "worker3", capture_output=True)
        trainer = subprocess.Popen([*COMPOSE, "run", "--rm", "-T", "trainer"], env=ENV,
                                   stdout=subprocess.PIPE, text=True)
        result, killed = None, False
        for line in trainer.stdout:
            if line.startswith("batch 0 20") and not killed:
                compose("kill", "worker2", capture_output=True)
                killed = True
                print("killed worker2 mid-epoch", flush=True)
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
        assert trainer.wait(300) == 0 and killed and result is not None, "the trainer failed"
        check(result, SAMPLES, {"worker1", "worker2", "worker3"})
        served = [sorted({n for b in epoch for n in b["node"]}) for epoch in result]
        assert "worker2" not in served[1], "worker2 was killed but served epoch 1"
        print(f"docker compose test passed: {len(result)} epochs of {len(result[0])} batches, "
              f"each exactly once; nodes per epoch {served}")
    except BaseException:
        subprocess.run([*COMPOSE, "logs", "--tail", "30"], env=ENV)
        raise
    finally:
        subprocess.run([*COMPOSE, "down", "-v", "--remove-orphans"], env=ENV, capture_output=True)


if __name__ == "__main__":
    main()
