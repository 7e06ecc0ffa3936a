"""`GET /v1/jobs` in pages on a real server over a real service (orchestrator/http/jobs.py): a user's pages hold
their own jobs only, each page full but the last, together every job of theirs once in the order the Ray client's
table has them (the reference); an admin's cover everyone's; `state` narrows them; the `Link: rel="next"` header
leads on, and HttpClient follows it."""

from __future__ import annotations

import httpx

from orchestrator.http.api import create_app
from orchestrator.http.api_client import HttpClient
from tests.helpers.http_server import NOBODYS_MODEL, root_alice_bob, running_server
from tests.helpers.service import job_dict, write_task_data


def pages(raw: httpx.Client, token: str, query: str) -> list[list[dict]]:
    """Every page of `GET /v1/jobs?<query>`, following the next links."""
    found, url = [], f"/v1/jobs?{query}"
    while url:
        answer = raw.get(url, headers={"Authorization": f"Bearer {token}"})
        assert answer.status_code == 200, answer.text
        found.append(answer.json())
        url = answer.links.get("next", {}).get("url")
    return found


def test_pages_cover_each_of_the_callers_jobs_once_and_no_one_elses(api, users, tmp_path):
    data = write_task_data(tmp_path / "data", "pages")
    root, alice, bob = root_alice_bob(users, tmp_path / "data")
    app = create_app(api.link, api.token, events_poll_s=0.1, users=users)
    with running_server(app) as url:
        as_alice, as_bob, as_root = HttpClient(url, alice), HttpClient(url, bob), HttpClient(url, root)
        mine = as_alice.submit_many([job_dict(f"a{i:02d}", data, 5) for i in range(13)], base_model=NOBODYS_MODEL)
        his = as_bob.submit_many([job_dict(f"b{i:02d}", data, 5) for i in range(6)], base_model=NOBODYS_MODEL)
        mine += as_alice.submit_many([job_dict(f"a{i:02d}", data, 5) for i in range(13, 22)],
                                     base_model=NOBODYS_MODEL)   # hers, bob's between them, never trained
        try:
            for handle in mine[:5]:
                as_alice.cancel(handle.id)
            reference = [r for r in api.ray.jobs() if r.user in ("alice", "bob")]   # the table's order
            hers = [r.id for r in reference if r.user == "alice"]
            assert sorted(hers) == sorted(h.id for h in mine)
            raw = httpx.Client(base_url=url, timeout=60)

            alices = pages(raw, alice, "limit=4")
            assert [len(page) for page in alices] == [4] * 5 + [2]   # filtered in the query: every page full
            assert [job["id"] for page in alices for job in page] == hers
            assert all(job["user"] == "alice" for page in alices for job in page)
            everyone = [job["id"] for page in pages(raw, root, "limit=5") for job in page]
            assert [i for i in everyone if i in {r.id for r in reference}] == [r.id for r in reference]
            cancelled = pages(raw, alice, "limit=2&state=cancelled")
            assert [job["id"] for page in cancelled for job in page] == [h.id for h in mine[:5]]
            assert [len(page) for page in cancelled] == [2, 2, 1]

            whole = raw.get("/v1/jobs", headers={"Authorization": f"Bearer {alice}"})   # no paging asked: all
            assert [job["id"] for job in whole.json()] == hers and "link" not in whole.headers
            bad = raw.get("/v1/jobs?after=yesterday", headers={"Authorization": f"Bearer {alice}"})
            assert bad.status_code == 422 and "no page cursor" in bad.json()["detail"], bad.text

            assert [r.id for r in as_alice.jobs()] == hers                       # HttpClient: every page
            assert {r.id for r in as_bob.jobs()} == {h.id for h in his}
            page = as_alice.jobs(limit=10)
            assert [r.id for r in page] == hers[:10] and page.next is not None
            rest = as_alice.jobs(limit=10, after=page.next)
            last = as_alice.jobs(limit=10, after=rest.next)
            assert [r.id for r in rest + last] == hers[10:] and last.next is None
            assert [r.id for r in as_root.jobs(["queued"]) if r.user == "bob"] == [h.id for h in his]
        finally:
            for record in api.ray.jobs(["queued"]):
                if record.user in ("alice", "bob"):
                    api.ray.cancel(record.id)
