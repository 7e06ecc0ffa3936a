"""The HTTP client reads jobs from servers of other versions: a newer server's job has fields this client does not
know (the server's `account_tokens` was one: a client of before it failed every call that returns a job with
"unexpected keyword argument"), an older server's lacks fields this client has. Answered by a real HTTP server."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from orchestrator.http.api_client import HttpClient

# a job as the server of 2026-12-06 (a58a204, before account_tokens) sent it, every field it had
OLDER = {"id": "j2", "name": "k", "state": "queued", "reason": "waiting for a trainer", "base_model": "smollm2-135m",
         "quantization": "none", "priority": 0, "output_dir": "/out/k", "trainer": None, "step": 0, "total_steps": 40,
         "tokens": 0, "loss": None, "eval_loss": None, "tokens_per_s": None, "checkpoint_step": None,
         "adapter_dir": None, "submitted_at": 1.0, "started_at": None, "finished_at": None, "updated_at": 1.0,
         "user": "alice", "eval_score": None, "reward": None, "reward_margin": None, "best": None}
NEWER = {**OLDER, "id": "j1", "name": "j", "state": "running", "step": 7, "tokens": 900, "account_tokens": 1200,
         "field_of_a_later_server": {"any": "value"}}


class _Server(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        jobs = {"/v1/jobs/j1": NEWER, "/v1/jobs/j2": OLDER}
        body = json.dumps(jobs[self.path] if self.path in jobs else [NEWER, OLDER]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_jobs_of_a_newer_and_an_older_server_are_read(url):
    with HttpClient(url, token="t") as client:
        newer, older = client.status("j1"), client.status("j2")
        listed = client.jobs()
    assert (newer.id, newer.state, newer.step, newer.tokens, newer.account_tokens) == ("j1", "running", 7, 900, 1200)
    assert not hasattr(newer, "field_of_a_later_server")
    assert (older.id, older.state, older.user, older.total_steps, older.account_tokens) == ("j2", "queued", "alice",
                                                                                            40, 0)
    assert [job.id for job in listed] == ["j1", "j2"]
