"""`HttpClient.submit(path)` is for a jobs file of one job, as `Client.submit(path)` (the Ray client, the reference
here, over the same service) is: given a file of two jobs, the HTTP client submitted both, then raised that the file
has two jobs, so the user was told to use submit_run() for jobs that were already queued. Now it refuses first, with
nothing entered, as the Ray client does."""

from __future__ import annotations

import pytest

from orchestrator.http.api_client import HttpClient
from orchestrator.jobs_file import SpecError
from tests.helpers.http_server import write_jobs_file
from tests.helpers.service import job_dict, write_task_data


def test_a_file_of_two_jobs_given_to_submit_enters_nothing_over_http_as_over_ray(api, tmp_path):
    data = write_task_data(tmp_path / "data", "pair")
    jobs_file = tmp_path / "two.yaml"
    write_jobs_file(jobs_file, api.base, [job_dict("pair-first", data, 2), job_dict("pair-second", data, 2)])
    with pytest.raises(SpecError) as over_ray:
        api.ray.submit(jobs_file)
    with pytest.raises(SpecError) as over_http:
        HttpClient(api.url, api.token).submit(jobs_file)
    entered = {record.name for record in api.ray.jobs()} & {"pair-first", "pair-second"}
    assert entered == set(), entered
    for refused in (over_ray.value, over_http.value):
        assert str(refused).startswith(f"{jobs_file}: has 2 jobs; ") and "submit_run()" in str(refused), refused
