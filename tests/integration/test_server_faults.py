"""Server-side faults against real server processes: a client that goes away mid-`/infer/`, SIGTERM during a
generation and during a sync.

- a disconnected `/infer/` client: the vLLM requests are aborted (the server is idle again long before the
  batch could have finished; counted in `rollmatch_infer_disconnects_total`), and the server keeps serving;
- SIGTERM while a generation runs (HF server): the running request is answered (drain), new connections are
  refused, the process exits 0;
- SIGTERM during a staged sync: exit 0, and the sync's staging files are gone;
- a learner SIGKILLed mid-sync: nothing applied, the abandoned sync expires and frees its staging, the next
  sync works.

Killing a learner in the middle of a collective (gloo) sync is `test_vllm_sync.py`'s
`test_collective_sync_whose_learner_goes_silent_changes_nothing`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import ServerProcess
from tests.integration.learner_fixtures import start_server
from tests.integration.vllm_helpers import checkpoint_tensors, encode_tensors

pytestmark = pytest.mark.integration


def metric(base_url: str, name: str) -> float:
    """The sum of the series `name` over its labels (0 before any label set has been seen)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def generation(n_prompts: int, max_tokens: int) -> dict[str, Any]:
    return {
        "infer_requests": [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(n_prompts)],
        "request_config": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0},
    }


def test_a_client_that_goes_away_stops_costing(vllm_server: ServerProcess) -> None:
    url = vllm_server.base_url
    prompts, short, long = 64, 128, 2000  # the session server's max_model_len is 2048
    started = time.monotonic()
    assert httpx.post(f"{url}/infer/", json=generation(prompts, short), timeout=300).status_code == 200
    full_s = (time.monotonic() - started) * long / short  # what the long batch would take (lower bound)
    disconnects = metric(url, "rollmatch_infer_disconnects_total")
    # The client goes away only once the server has the whole batch in flight, so the test does not depend on
    # how fast this machine generates (a read timeout did, and fired after the answer on a loaded CI host).
    host, port = httpx.URL(url).host, httpx.URL(url).port
    body = json.dumps(generation(prompts, long)).encode()
    client = socket.create_connection((host, port), timeout=30)
    client.sendall(
        f"POST /infer/ HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    deadline = time.monotonic() + 60
    while metric(url, "rollmatch_infer_samples_in_flight") < prompts:
        assert time.monotonic() < deadline, "the server never started the long batch"
        time.sleep(0.02)
    client.setblocking(False)
    try:
        early = client.recv(200)
    except BlockingIOError:
        early = b""
    assert not early, f"the long batch was answered before the client left: {early!r}"
    client.close()
    gone = time.monotonic()
    while metric(url, "rollmatch_infer_samples_in_flight") > 0:
        assert time.monotonic() - gone < full_s / 4, (
            f"the batch kept generating (a full run: ~{full_s:.1f} s)"
        )
        time.sleep(0.05)
    assert metric(url, "rollmatch_infer_disconnects_total") == disconnects + 1
    assert httpx.post(f"{url}/infer/", json=generation(2, 4), timeout=60).status_code == 200


def test_sigterm_during_a_generation_drains_it_and_exits_0(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_model_dir, tmp_path, backend="hf", max_model_len=512)
    try:
        answers: list[httpx.Response] = []
        thread = threading.Thread(
            target=lambda: answers.append(
                httpx.post(f"{server.base_url}/infer/", json=generation(8, 300), timeout=120)
            )
        )
        thread.start()
        deadline = time.monotonic() + 30
        while metric(server.base_url, "rollmatch_infer_calls_in_flight") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        thread.join(60)
        assert [a.status_code for a in answers] == [200]  # the in-flight request was answered
        assert len(answers[0].json()["results"]) == 8
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.base_url}/health", timeout=5)
    finally:
        server.stop()


def test_sigterm_during_a_sync_exits_0_and_removes_its_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_model_dir, tmp_path, backend="hf", max_model_len=512)
    pools_before = set(Path("/dev/shm").glob("rollmatch-sync-pool-*")) if os.path.isdir("/dev/shm") else set()
    try:
        buckets, blobs = encode_tensors(checkpoint_tensors(tiny_model_dir), 1 << 16)
        begin = httpx.post(
            f"{server.base_url}/sync_weights/begin",
            json={"manifest": {"mode": "full", "version": 1, "buckets": buckets}},
            timeout=30,
        )
        sync_id = begin.json()["sync_id"]
        ack = httpx.put(f"{server.base_url}/sync_weights/{sync_id}/buckets/0", content=blobs[0], timeout=30)
        assert ack.status_code == 200
        assert set(Path("/dev/shm").glob("rollmatch-sync-pool-*")) - pools_before, "the body is staged"
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    assert set(Path("/dev/shm").glob("rollmatch-sync-pool-*")) - pools_before == set()
    assert not any(server.shm_dir.glob(".rollmatch-staged-*")) if server.shm_dir.exists() else True


LEARNER_DIES_MID_SYNC = """
import os, signal, sys
import httpx
sys.path.insert(0, {repo!r})
from tests.integration.vllm_helpers import checkpoint_tensors, encode_tensors
buckets, blobs = encode_tensors(checkpoint_tensors({model!r}), 1 << 16)
url = {url!r}
begin = httpx.post(url + "/sync_weights/begin", json={{"manifest": {{"mode": "full", "version": {version},
    "buckets": buckets}}}}, timeout=30).json()
ack = httpx.put(f"{{url}}/sync_weights/{{begin['sync_id']}}/buckets/0", content=blobs[0], timeout=30)
assert ack.status_code == 200
print("staged", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_learner_killed_mid_sync_changes_nothing_and_its_sync_expires(
    tiny_model_dir: Path, tiny_model_dir_seed1: Path, tmp_path: Path
) -> None:
    """A learner process SIGKILLed after its first bucket: nothing applied, the version unchanged, the
    abandoned sync expires (`server.sync_timeout_s`) and frees its staging, and the next learner's sync
    works."""
    import subprocess
    import sys

    from tests.integration.learner_fixtures import REPO

    server = start_server(tiny_model_dir, tmp_path, backend="hf", max_model_len=512, sync_timeout_s=2.0)
    pools_before = set(Path("/dev/shm").glob("rollmatch-sync-pool-*"))
    try:
        before = httpx.post(f"{server.base_url}/infer/", json=generation(2, 8), timeout=60).json()
        script = LEARNER_DIES_MID_SYNC.format(
            repo=str(REPO), model=str(tiny_model_dir_seed1), url=server.base_url, version=1
        )
        learner = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert learner.returncode == -signal.SIGKILL and "staged" in learner.stdout, learner.stderr[-2000:]
        assert server.weight_version() == 0
        deadline = time.monotonic() + 30
        while metric(server.base_url, "rollmatch_weight_syncs_total") < 1:  # expired, counted
            assert time.monotonic() < deadline, "the abandoned sync never expired"
            time.sleep(0.2)
        assert 'outcome="expired"' in httpx.get(f"{server.base_url}/metrics", timeout=10).text
        assert not list(
            next(iter(set(Path("/dev/shm").glob("rollmatch-sync-pool-*")) - pools_before)).iterdir()
        )
        after = httpx.post(f"{server.base_url}/infer/", json=generation(2, 8), timeout=60).json()
        assert [r["choices"] for r in after["results"]] == [r["choices"] for r in before["results"]]
        buckets, blobs = encode_tensors(checkpoint_tensors(tiny_model_dir_seed1), 1 << 16)
        sync_id = httpx.post(
            f"{server.base_url}/sync_weights/begin",
            json={"manifest": {"mode": "full", "version": 1, "buckets": buckets}},
            timeout=30,
        ).json()["sync_id"]
        for index, blob in enumerate(blobs):
            put = httpx.put(
                f"{server.base_url}/sync_weights/{sync_id}/buckets/{index}", content=blob, timeout=30
            )
            assert put.status_code == 200
        commit = httpx.post(f"{server.base_url}/sync_weights/commit", json={"sync_id": sync_id}, timeout=60)
        assert commit.status_code == 200 and server.weight_version() == 1
    finally:
        server.stop()
