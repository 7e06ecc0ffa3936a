"""The web console (orchestrator/http/console.py, orchestrator/console/static) in a real browser: Debian's
chromium, headless, driven by Playwright, against the HTTP API on a uvicorn server over a real service on
the session's Ray with a tiny Llama. What each page shows is checked against the API's own JSON for the
same thing; the refusals are caused for real (a wrong token, malformed YAML, another user's job, trying a
job that is not running). Screenshots of each page go to $ASPEN_CONSOLE_SCREENSHOTS (docs/console for the
docs) or the test's tmp folder. Under CI=true a missing chromium or playwright fails the test."""

from __future__ import annotations

import json
import os
import re
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import ray

from actors.service.accounts.audit import AuditLog
from actors.service.accounts.users import UserBook
from orchestrator.cli.main import main
from orchestrator.client import Client
from orchestrator.http.api import ServiceLink, create_app
from orchestrator.http.api_client import HttpClient
from orchestrator.http.console import STATIC_DIR
from orchestrator.http.token import ensure_token
from tests.helpers.http_server import NOBODYS_MODEL, running_server
from tests.helpers.service import NO_LISTENERS, job_dict, service_config, wait_for, write_task_data

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
VIEWPORT = {"width": 1280, "height": 800}
WAIT_MS = 60_000
LONG_STEPS = 5000   # the job the first test follows, tries and cancels


def browser_or_skip() -> None:
    """chromium and playwright present, or a skip (a failure under CI=true) saying how to get them."""
    problems = []
    if not Path(CHROMIUM).is_file():
        problems.append(f"no {CHROMIUM} (Debian/Ubuntu: apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        problems.append("no playwright (pip install -e '.[dev]')")
    if not problems:
        return
    message = "the console's browser test needs " + " and ".join(problems)
    if os.environ.get("CI") == "true":
        pytest.fail(message + "; under CI a server-backed test fails instead of skipping")
    pytest.skip(message)


@dataclass
class Console:
    url: str
    service: Client        # the reference: the same service through the Ray client
    base: str
    data: Path
    tokens: dict[str, str]
    shots: Path
    state_dir: Path

    def http(self, user: str) -> HttpClient:
        return HttpClient(self.url, self.tokens[user])


@pytest.fixture(scope="module")
def console(ray_session, tiny_model_dirs, tmp_path_factory) -> Iterator[Console]:
    browser_or_skip()
    base = tiny_model_dirs["llama"]
    state_dir = tmp_path_factory.mktemp("state")
    data = write_task_data(tmp_path_factory.mktemp("data"), "sql", rows=48)
    service = Client.local(service_config(state_dir, base, listeners=NO_LISTENERS),
                           name=f"aspen-console-test-{uuid.uuid4().hex[:6]}")
    users = UserBook.in_state_dir(state_dir)
    tokens = {"root": users.add("root", admin=True)[0],
              "alice": users.add("alice", data_roots=[str(data.parent)])[0],
              "bob": users.add("bob", data_roots=[str(data.parent)])[0]}
    token = ensure_token(tmp_path_factory.mktemp("token") / "http-token")
    app = create_app(ServiceLink(client=service), token, events_poll_s=0.2, users=users,
                     audit=AuditLog.in_state_dir(state_dir))
    shots = Path(os.environ.get("ASPEN_CONSOLE_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    shots.mkdir(parents=True, exist_ok=True)
    try:
        with running_server(app) as url:
            yield Console(url, service, str(base), data, tokens, shots, state_dir)
    finally:
        service.shutdown()


@pytest.fixture(scope="module")
def browser(console):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def log_in(browser, console: Console, user: str):
    return log_in_at(browser, console.url, console.tokens[user])


def log_in_at(browser, url: str, token: str):
    """A new page of the console at `url`, logged in with `token`."""
    page = browser.new_page(viewport=VIEWPORT)
    page.set_default_timeout(WAIT_MS)
    page.goto(url + "/")
    page.fill("#token", token)
    page.click("#login-form button[type=submit]")
    page.wait_for_selector("#nav:not([hidden])")
    return page


def one_job_yaml(base, name: str, data, prompt: str) -> str:
    """A jobs file of one two-step job of `prompt` (its data line is line 4)."""
    return (f"base_model: {base}\njobs:\n  - name: {name}\n    data: {data}\n"
            f"    format: {{type: prompt_response, prompt: '{prompt}', response: ' {{answer}}'}}\n"
            "    batch_size: 2\n    max_seq_len: 128\n    max_steps: 2\n")


def shot(page, console: Console, name: str) -> None:
    page.screenshot(path=str(console.shots / f"{name}.png"))


ENDED_AT_ONCE = "(no text: the first new token ended the answer)"   # as pages/job.js shows an empty answer


def test_the_console_ships_every_asset_and_refers_to_no_other_host():
    """Every file the pages load is in the package folder, and none names another host (a licence banner
    comment aside): the console works offline."""
    files = [p for p in STATIC_DIR.rglob("*") if p.is_file()]
    names = {p.relative_to(STATIC_DIR).as_posix() for p in files}
    assert {"index.html", "console.css", "js/app.js", "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css"} <= names
    index = (STATIC_DIR / "index.html").read_text()
    for ref in re.findall(r'(?:src|href)="([^"#]+)"', index):
        assert (STATIC_DIR / ref).is_file(), ref
    for path in files:
        if path.suffix not in (".html", ".js", ".css"):
            continue
        text = re.sub(r"/\*!.*?\*/", "", path.read_text(), flags=re.S)   # licence banners
        assert not re.findall(r"https?://", text), path
        for module in re.findall(r'from "(\.[^"]+)"', text):   # every module an import names is there
            assert (path.parent / module).resolve().is_file(), (path, module)


def test_log_in_follow_jobs_try_an_adapter_submit_and_cancel(console, browser):
    """One user's tour, the long job training throughout (each part below): log in, follow the jobs table live,
    the job's page and trying its adapter, what cannot be tried or seen, submitting, cancelling from the table."""
    _a_wrong_token_is_refused(console, browser)
    alice, bob = console.http("alice"), console.http("bob")
    page = log_in(browser, console, "alice")
    assert page.text_content("#who") == "alice"
    long_job, queued, bobs = _jobs_appear_and_advance_live(page, console, alice, bob)
    row = f"#jobs-table tr[data-job='{long_job.id}']"
    page.click(f"{row} a")
    _the_jobs_page_charts_serves_and_tries_it(page, console, alice, long_job)
    _what_is_not_running_or_not_yours_says_so(page, console, queued, bobs)
    entered = _submitted_yaml_is_checked_line_by_line(page, console, alice, long_job)
    # cancel from the table: select, cancel, the row's state changes
    page.goto(f"{console.url}/#/jobs")
    page.check(f"input[data-job='{long_job.id}']")
    page.check(f"input[data-job='{entered[0].id}']")
    assert page.text_content("#view > p.status").endswith("; 2 selected")   # it stayed at 0 selected
    page.click("button[data-verb=cancel]")
    page.wait_for_selector(f"{row}[data-state=cancelled]")
    assert alice.status(long_job.id).state == "cancelled" and alice.status(entered[0].id).state == "cancelled"
    # the outcome stays through the live updates that follow (each redraw wiped it within half a second)
    page.wait_for_function("document.querySelector('#view > p.status').textContent.endsWith('cancel: 2 jobs')")
    page.wait_for_timeout(1500)
    assert page.text_content("#view > p.status").endswith("; 0 selected. cancel: 2 jobs")
    alice.cancel(queued.id)
    bob.cancel(bobs.id)
    page.close()


def _a_wrong_token_is_refused(console, browser) -> None:
    # a wrong token is refused, and the login stays
    page = browser.new_page(viewport=VIEWPORT)
    page.set_default_timeout(WAIT_MS)
    page.goto(console.url + "/")
    page.fill("#token", "not-a-token-of-anyone-at-all")
    page.click("#login-form button[type=submit]")
    page.wait_for_function("document.querySelector('#login-error').textContent.includes('wrong token')")
    assert page.is_visible("#login") and page.is_hidden("#nav")
    shot(page, console, "login")
    page.close()


def _jobs_appear_and_advance_live(page, console, alice, bob):
    """Jobs submitted after the page opened appear and advance without a reload; keyboard focus survives redraws.
    Returns alice's long and queued jobs and bob's."""
    # jobs submitted after the page opened appear, and their steps advance, without reloading. The long job must
    # train through the whole tour below (its steps advancing, its chart, trying it) until it is cancelled from
    # the table: it was at step 225 of 400 when that cancel came, 4.4 s in on an idle machine, so a browser slowed
    # by a loaded 2-core machine beside 6-13 ms steps could see it completed. 5000 steps leave >=25 s at a >=5 ms
    # floor and cost nothing (it is cancelled)
    long_job = alice.submit(job_dict("alice-long", console.data, LONG_STEPS, checkpoint_every=10_000),
                            base_model=console.base)
    queued = alice.submit(job_dict("alice-queued", console.data, 2), base_model=NOBODYS_MODEL)
    bobs = bob.submit(job_dict("bobs-job", console.data, 2), base_model=NOBODYS_MODEL)
    row = f"#jobs-table tr[data-job='{long_job.id}']"
    page.wait_for_selector(f"{row}[data-state=running]")
    first = int(page.text_content(f"{row} .step").split("/")[0])
    page.wait_for_function(f"parseInt(document.querySelector(\"{row} .step\").textContent) > {first}")
    assert page.url.endswith("/") or "#/jobs" in page.url            # the same page: no reload, no navigation
    shown = {r.get_attribute("data-job") for r in page.query_selector_all("#jobs-table tbody tr[data-job]")}
    assert shown == {r.id for r in alice.jobs()} == {long_job.id, queued.id}   # not bob's
    assert page.text_content(f"{row} td:nth-child(12)") == "alice"
    shot(page, console, "jobs")
    # keyboard focus stays on the row's checkbox while live updates redraw the table
    page.focus(f"{row} input[type=checkbox]")
    now = int(page.text_content(f"{row} .step").split("/")[0])
    page.wait_for_function(f"parseInt(document.querySelector(\"{row} .step\").textContent) > {now}")
    assert page.evaluate("document.activeElement.getAttribute('data-job')") == long_job.id
    # and acts on it, even when a live update redraws the table between the key's press and its release
    page.keyboard.down("Space")
    now = int(page.text_content(f"{row} .step").split("/")[0])
    page.wait_for_function(f"parseInt(document.querySelector(\"{row} .step\").textContent) > {now}")
    page.keyboard.up("Space")
    assert page.is_checked(f"{row} input[type=checkbox]")   # selected
    page.keyboard.press("Space")
    return long_job, queued, bobs


def _the_jobs_page_charts_serves_and_tries_it(page, console, alice, long_job) -> None:
    # the job's page (opened from its row): its loss curve gains points as it trains
    page.wait_for_selector("[data-chart=loss] figcaption")
    caption = "document.querySelector('[data-chart=loss] figcaption').textContent"
    points = int(re.search(r"\((\d+) points", page.text_content("[data-chart=loss] figcaption")).group(1))
    page.wait_for_function(f"parseInt({caption}.match(/\\((\\d+) points/)[1]) > {points + 1}")
    # the step axis has whole steps only (a few points once gave ticks like 1.5)
    ticks = page.get_attribute("[data-chart=loss]", "data-step-ticks").split(",")
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    numbers = page.query_selector_all("[data-chart=loss] .numbers tbody tr")
    assert len(numbers) <= len(alice.losses(long_job.id)) and len(numbers) > points   # the API's rows, as they grow
    # the lines that serve and load its adapter name this machine's copy of the base and the job's folder
    serving = alice.serving(long_job.id)
    assert page.text_content("#vllm-line") == serving["vllm"]
    assert page.text_content("#peft-lines") == serving["peft"]
    assert f"from_pretrained({str(console.base)!r})" in serving["peft"]
    assert repr(str(Path(alice.status(long_job.id).output_dir).resolve())) in serving["peft"]
    assert serving["vllm"].startswith(f"vllm serve {console.base} --enable-lora --max-lora-rank ")
    assert page.text_content("#spec-yaml").count("alice-long") == 1
    assert f"max_steps: {LONG_STEPS}" in page.text_content("#spec-yaml")
    # try it: the prompt continued through the adapter and through the base alone, on its trainer
    page.fill("#try-prompt", "Q: sql 3 and 9\nA:")
    page.fill("#try-tokens", "8")
    page.click(".try button[type=submit]")
    page.wait_for_selector("#try-base")
    reference = alice.generate(long_job.id, "Q: sql 3 and 9\nA:", 8)   # the base alone does not change as it trains
    assert page.text_content("#try-base") == reference["base"] and reference["base"]
    # the adapter's own answer changes as it trains; a trained tiny model may end at once (its data's answers end
    # with the end-of-text token): the page then says so rather than showing nothing
    assert page.text_content("#try-adapter").strip()
    shot(page, console, "job-try")
    page.evaluate("window.scrollTo(0, 0)")
    shot(page, console, "job")


def _what_is_not_running_or_not_yours_says_so(page, console, queued, bobs) -> None:
    # a job that is not running cannot be tried (the API answers 409): the page offers no form, it says why;
    # another user's job is not found
    page.goto(f"{console.url}/#/jobs/{queued.id}")
    page.wait_for_selector("#try-note")
    assert "works while the job trains" in page.text_content("#try-note") and "queued" in page.text_content("#try-note")
    assert page.query_selector("#try-prompt") is None
    refused = httpx.post(f"{console.url}/v1/jobs/{queued.id}/generate", json={"prompt": "hello"},
                         headers={"Authorization": f"Bearer {console.tokens['alice']}"})
    assert refused.status_code == 409
    page.goto(f"{console.url}/#/jobs/{bobs.id}")
    page.wait_for_selector("#view .error")
    assert "not found" in page.text_content("#view .error").lower()


def _submitted_yaml_is_checked_line_by_line(page, console, alice, long_job) -> list:
    """Malformed YAML and an unknown field refused with their lines marked; a good file entered; a job cloned.
    Returns the jobs the good file entered."""
    # submit: malformed YAML and an unknown field are refused, each with its line marked (as the API says)
    page.goto(f"{console.url}/#/submit")
    for bad, line, field in ((f"jobs:\n  - name: bad\n    data: {console.data}\n   max_steps: 2\n", None, None),
                             (f"jobs:\n  - name: bad\n    data: {console.data}\n    format: {{type: alpaca}}\n"
                              "    max_stepz: 2\n    lr: 0.001\n", 5, "jobs.0.max_stepz")):
        answer = httpx.post(f"{console.url}/v1/jobs", content=bad, headers={
            "Authorization": f"Bearer {console.tokens['alice']}", "Content-Type": "application/yaml"})
        assert answer.status_code == 422
        errors = answer.json()["errors"]
        line = line or errors[0]["line"]
        assert field is None or (f"request:{line}:" in answer.json()["detail"] and errors[0]["field"] == field), errors
        page.fill("#jobs-yaml", bad)
        page.click("form button[type=submit]")
        page.wait_for_selector(f".gutter span[data-line='{line}'].marked")
        assert f"At line {line}." in page.text_content("#submit-error .at-lines")
        assert [s.get_attribute("data-line") for s in page.query_selector_all(".gutter .marked")] == [str(line)]
        if field:
            assert field in page.text_content("#submit-error ul")
    shot(page, console, "submit-error")
    # a data row that does not fit its job's format: the job's data line marked, the file's row and field said
    typo = one_job_yaml(console.base, "typo", console.data, "Q: {questio}")
    page.fill("#jobs-yaml", typo)
    page.click("form button[type=submit]")
    page.wait_for_selector(".gutter span[data-line='4'].marked")
    assert "At line 4." in page.text_content("#submit-error .at-lines")
    message = page.text_content("#submit-error pre")
    assert f"job 'typo' (jobs[0]), field data: {console.data}:1: field 'questio' is missing" in message, message
    assert message.endswith("(fix the rows or the format, then submit again)")
    assert "jobs.0.data" in page.text_content("#submit-error ul")
    before = {r.id for r in alice.jobs()}
    good = one_job_yaml(NOBODYS_MODEL, "from-the-console", console.data, "Q: {question}")
    page.fill("#jobs-yaml", good)
    page.click("form button[type=submit]")
    page.wait_for_selector("#submit-result .ok")
    entered = [r for r in alice.jobs() if r.id not in before]
    assert [r.name for r in entered] == ["from-the-console"]
    assert page.text_content("#submit-result li a") == "from-the-console"
    # clone an existing job's spec
    page.goto(f"{console.url}/#/submit?clone={long_job.id}")
    page.wait_for_function("document.querySelector('#jobs-yaml').value.includes('alice-long')")
    assert page.input_value("#jobs-yaml") == alice.spec(long_job.id)["yaml"]
    return entered


@pytest.mark.long   # ~60 s on CI's machine: a sweep's trials trained to its leaderboard, seen in a real browser
def test_the_trainers_page_shows_what_the_service_reports_going_wrong(ray_session, tiny_model_dirs, tmp_path,
                                                                     browser):
    """A service whose metrics port was taken runs without metrics and says so (`info()["metrics_error"]`); an
    operator on the console's Trainers page sees it there too, word for word, as an alert (a service of its
    own: the module's has nothing going wrong)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        listeners = {"events": {"enabled": False}, "metrics": {"port": port}}
        service = Client.local(service_config(tmp_path / "state", tiny_model_dirs["llama"], listeners=listeners),
                               name=f"aspen-console-test-{uuid.uuid4().hex[:6]}")
    try:
        error = service.info()["metrics_error"]
        assert f"127.0.0.1:{port}" in error
        token = ensure_token(tmp_path / "http-token")
        with running_server(create_app(ServiceLink(client=service), token)) as url:
            page = log_in_at(browser, url, token)
            page.goto(f"{url}/#/trainers")
            page.wait_for_selector("[data-trainer]")
            alerts = [a.text_content() for a in page.query_selector_all("#view [role=alert]")]
            assert alerts == [f"metrics error: {error}"], alerts
            page.close()
    finally:
        service.shutdown()


def test_an_admin_sees_everyone_trainers_and_a_sweep_leaderboard(console, browser):
    root = console.http("root")
    out = console.state_dir / "outputs" / "root" / "sweep"   # under the admin's own outputs' folder
    # one trial at a time, the good rate first: the hopeless one meets its result at the first rung and is
    # stopped there (tests/service/test_sweep.py: the same pair), so the chart has a stopped curve to mark. It is
    # judged only once the scheduler sees its first eval (a tick, 0.1 s, after the trainer's poll answers: up to
    # seconds on a loaded 2-core machine), and a trial that ended first is not stopped (nothing is left to save):
    # at 24 steps, judged at step 4, 6-13 ms a step here, it once ended first in CI. Judged at step 20 of 400, 380
    # steps are left, >=1.9 s at a >=5 ms floor
    sweep = {"name": "console-lr", "base_model": console.base, "output_dir": str(out),
             "step_tokens": 512, "search": "grid", "max_concurrent": 1, "space": {"lr": {"choice": [5e-3, 1e-9]}},
             "stopping": {"asha": {"grace_steps": 20, "reduction": 2}},
             "job": {**job_dict("lr", console.data, 400, eval_split=4, eval_every=20), "checkpoint_every": 1000}}
    root.sweep(sweep)
    bobs = console.http("bob").submit(job_dict("bobs-waiting", console.data, 2), base_model=NOBODYS_MODEL)
    page = log_in(browser, console, "root")
    assert page.text_content("#who") == "root (admin)"
    page.wait_for_selector("#filter-user")
    wait_for(lambda: page.query_selector_all("#filter-user option[value=bob]"), 30, "bob in the user filter")
    everyone = {r.id for r in root.jobs()}
    page.wait_for_function(f"document.querySelectorAll('#jobs-table tbody tr[data-job]').length >= {len(everyone)}")
    page.select_option("#filter-user", "bob")
    shown = {r.get_attribute("data-job") for r in page.query_selector_all("#jobs-table tbody tr[data-job]")}
    assert shown == {r.id for r in root.jobs() if r.user == "bob"} and bobs.id in shown
    accounts = {a["user"] for a in root.accounts()}
    assert {row.text_content() for row in page.query_selector_all("#view section table tbody td:first-child")} \
        >= {a or "(operator)" for a in accounts}

    page.goto(f"{console.url}/#/trainers")
    page.wait_for_selector("[data-trainer]")
    trainers = root.info()["trainers"]
    assert [c.get_attribute("data-trainer") for c in page.query_selector_all("[data-trainer]")] == \
        [t["id"] for t in trainers]
    assert console.base in page.text_content("[data-trainer]")
    shot(page, console, "trainers")

    status = wait_for(lambda: (s := root.sweep_status("console-lr"))["state"] != "running" and s, 120, "the sweep",
                      state=lambda: [(r.name, r.state, r.reason) for r in root.jobs()])
    assert status["state"] == "done", status
    page.goto(f"{console.url}/#/sweeps/console-lr")
    page.wait_for_selector(".leaderboard tbody tr")
    names = [r.text_content() for r in page.query_selector_all(".leaderboard tbody td:nth-child(2)")]
    assert names == [t["name"] for t in status["trials"]]
    page.wait_for_selector("[data-chart=trials]")
    stopped = [t["name"] for t in status["trials"] if t["state"] == "stopped"]
    assert len(stopped) == 1, status["trials"]
    states = [r.text_content() for r in page.query_selector_all(".leaderboard tbody td:nth-child(3)")]
    assert states == [t["state"] for t in status["trials"]]
    headers = [h.text_content() for h in page.query_selector_all("[data-chart=trials] .numbers thead th")]
    assert f"{stopped[0]} (stopped)" in headers, headers   # its curve marked (dashed) in the chart and its numbers
    best = next(r for r in root.jobs() if r.name == status["best"])
    assert page.text_content("#best-adapter") == best.adapter_dir
    shot(page, console, "sweeps")
    page.close()

    # a phone's screen: the jobs page lays out in one column and still answers
    phone = browser.new_page(viewport={"width": 390, "height": 800})
    phone.goto(console.url + "/")
    phone.fill("#token", console.tokens["root"])
    phone.press("#token", "Enter")   # the keyboard alone
    phone.wait_for_selector("#jobs-table tbody tr[data-job]")
    assert phone.evaluate("document.documentElement.scrollWidth") <= 390 + 1
    phone.close()
    if os.environ.get("ASPEN_CONSOLE_SCREENSHOTS"):
        assert {p.name for p in console.shots.glob("*.png")} >= {
            "login.png", "jobs.png", "job.png", "job-try.png", "submit-error.png", "trainers.png", "sweeps.png"}
    console.http("bob").cancel(bobs.id)


def test_a_jobs_generation_score_is_shown_in_the_table_and_on_its_page(console, browser):
    """A job with eval_generate: its last score, as the API's record has it, in the jobs table's column and on
    its page; a job without one shows none."""
    alice = console.http("alice")
    scored = alice.submit(job_dict("alice-scored", console.data, 4, eval_split=4, eval_every=2,
                                   eval_generate={"metric": "contains", "max_new_tokens": 4}),
                          base_model=console.base)
    assert scored.wait(timeout=120).state == "completed"
    score = alice.status(scored.id).eval_score
    assert score is not None and 0.0 <= score <= 1.0
    page = log_in(browser, console, "alice")
    row = f"#jobs-table tr[data-job='{scored.id}']"
    page.wait_for_selector(f"{row}[data-state=completed]")
    assert page.text_content(f"{row} .eval-score") == page.evaluate(f"Number({score!r}).toPrecision(4)")
    assert {c.text_content() for c in page.query_selector_all(
        "#jobs-table tr[data-job]:not([data-job='" + scored.id + "']) .eval-score")} <= {"–"}
    page.click(f"{row} a")
    page.wait_for_selector("[data-chart=loss] figcaption")
    shown = page.evaluate("[...document.querySelectorAll('#view dt')].find((dt) => dt.textContent === 'eval score')"
                          "?.nextElementSibling.textContent")
    assert shown == page.evaluate(f"Number({score!r}).toPrecision(4)")

    # its generations: the API's answer is the job's generations.jsonl (each evaluation's rows), and the page shows
    # the last evaluation's rows, and an earlier one picked
    lines = [json.loads(line) for line in
             (Path(alice.status(scored.id).output_dir) / "generations.jsonl").read_text().splitlines()]
    answer = alice.generations(scored.id)
    assert answer["steps"] == [2, 4] and answer["step"] == 4
    assert answer["rows"] == [row for row in lines if row["step"] == 4] and len(answer["rows"]) == 4
    assert sum(row["score"] for row in answer["rows"]) / 4 == pytest.approx(score)
    assert alice.generations(scored.id, step=2)["rows"] == [row for row in lines if row["step"] == 2]
    with pytest.raises(Exception, match=r"no generations after step 3.*steps \[2, 4\]"):
        alice.generations(scored.id, step=3)
    with pytest.raises(Exception, match="not found|404"):
        console.http("bob").generations(scored.id)   # another user's job
    page.wait_for_selector(".generations-table tbody tr")

    def table_rows() -> list[list[str]]:
        return page.evaluate("[...document.querySelectorAll('.generations-table tbody tr')].map((tr) =>"
                             " [...tr.children].map((td) => td.textContent))")

    def expected(rows: list[dict]) -> list[list[str]]:
        return [[str(r["row"]), r["prompt"], r["reference"], r["prediction"] or "(no text)",
                 page.evaluate(f"Number({r['score']!r}).toPrecision(4)")] for r in rows]

    assert table_rows() == expected(answer["rows"])
    page.select_option("#generations-step", "2")
    page.wait_for_function("document.querySelector('#generations-step').value === '2'")
    wait_for(lambda: table_rows() == expected([row for row in lines if row["step"] == 2]), 30,
             "the step-2 evaluation's rows")
    page.evaluate("document.querySelector('section.generations').scrollIntoView()")
    shot(page, console, "job-generations")
    page.close()


def test_an_ended_jobs_page_shows_its_kept_evaluation_and_trains_it_on_to_more_steps(console, browser):
    """A completed keep_best job's page: its kept evaluation as the API's record has it, and "Extend" (POST /extend):
    the job trains on from its checkpoint to the steps given, its page following it there."""
    alice = console.http("alice")
    job = alice.submit(job_dict("alice-extended", console.data, 4, eval_split=4, eval_every=2, keep_best="eval_loss",
                                lr_schedule="constant"), base_model=console.base)
    assert job.wait(timeout=120).state == "completed"
    best = alice.status(job.id).best
    page = log_in(browser, console, "alice")
    page.goto(f"{console.url}/#/jobs/{job.id}")
    page.wait_for_selector("#extend-steps")
    kept = page.evaluate("[...document.querySelectorAll('#view dt')].find((dt) => dt.textContent === 'best (kept)')"
                         "?.nextElementSibling.textContent")
    value = page.evaluate(f"Number({best['value']!r}).toPrecision(4)")
    assert kept == f"eval loss {value} at step {best['step']}"
    page.fill("#extend-steps", "7")
    page.click("form.extend button[type=submit]")
    page.wait_for_function("!document.querySelector('.job-head .state-completed')")   # queued again
    assert wait_for(lambda: (r := alice.status(job.id)).state == "completed" and r, 120,
                    "the job to train on").step == 7
    assert [row["step"] for row in alice.losses(job.id)] == list(range(1, 8))
    page.wait_for_function("document.querySelector('.job-head dl').textContent.includes('7 / 7')")
    page.close()


def test_what_the_user_types_in_extend_survives_the_pages_redraws(console, browser):
    """The job's page redraws its head live (its spec read, each event of the job): a value typed in the Extend form
    meanwhile stays, focused, and is the one sent (it was reset to the default, twice the steps, and a click then
    extended the job to that). The spec's answer is held back until the user has typed, so that its redraw comes
    after; the job ends at the typed step, as the API's record has it."""
    alice = console.http("alice")
    job = alice.submit(job_dict("alice-typed", console.data, 2), base_model=console.base)
    assert job.wait(timeout=120).state == "completed"
    page = log_in(browser, console, "alice")
    held = []
    page.route(f"**/v1/jobs/{job.id}/spec", lambda route: held.append(route))   # answered once typed in
    with page.expect_request(f"**/v1/jobs/{job.id}/spec"):
        page.goto(f"{console.url}/#/jobs/{job.id}")
    page.wait_for_selector("#extend-steps")
    page.fill("#extend-steps", "5")
    assert held, "the spec's request was not held back"
    held[0].continue_()
    page.wait_for_selector("#spec-yaml")   # the head redrawn with the spec's budget
    assert page.input_value("#extend-steps") == "5"
    assert page.evaluate("document.activeElement.id") == "extend-steps"
    page.click("form.extend button[type=submit]")
    page.wait_for_function("!document.querySelector('.job-head .state-completed')")   # queued again
    assert wait_for(lambda: (r := alice.status(job.id)).state == "completed" and r, 120,
                    "the job to train on").step == 5
    page.close()


def test_a_job_its_epochs_ended_is_extended_by_epochs_from_its_page(console, browser):
    """A job bound by `epochs` (no max_steps) is extended to more epochs (POST /extend {"epochs"}): a larger max_steps
    would train nothing more, so its page's form asks for the epoch to train on to; the job trains its second epoch
    from its checkpoint (48 rows in batches of 16: 3 steps an epoch), as the API's record and losses show."""
    alice = console.http("alice")
    spec = job_dict("alice-epochs", console.data, 1, batch_size=16, max_seq_len=32, epochs=1,
                    lr_schedule="constant")
    del spec["max_steps"]
    job = alice.submit(spec, base_model=console.base)
    assert (ended := job.wait(timeout=120)).state == "completed" and ended.step == 3
    page = log_in(browser, console, "alice")
    page.goto(f"{console.url}/#/jobs/{job.id}")
    page.wait_for_selector("label[for=extend-steps]:text('Train on to epoch')")
    assert page.input_value("#extend-steps") == "2"
    page.click("form.extend button[type=submit]")
    page.wait_for_function("!document.querySelector('.job-head .state-completed')")   # queued again
    record = wait_for(lambda: (r := alice.status(job.id)).state == "completed" and r.step > 3 and r, 120,
                      "the job to train its second epoch")
    assert record.step == 6 and "epochs 1 -> 2" in " ".join(reason for _, _, reason in alice.transitions(job.id))
    assert [row["step"] for row in alice.losses(job.id)] == list(range(1, 7))
    page.close()


def test_a_grpo_jobs_page_charts_its_reward_as_the_api_has_it(console, browser, monkeypatch, capsys):
    """A GRPO job's page has a reward chart whose numbers are the job's rows' rewards (GET /v1/jobs/{job}/losses,
    the job table's copy of its metrics.jsonl); an SFT job's page has none, and its ended adapter can be tried."""
    alice = console.http("alice")
    grpo = alice.submit(job_dict("alice-grpo", console.data, 3, method="grpo", batch_size=2, max_seq_len=64,
                                 grpo={"reward": "contains", "num_generations": 2, "max_new_tokens": 4}),
                        base_model=console.base)
    assert grpo.wait(timeout=120).state == "completed"
    rewards = [row["reward"] for row in alice.losses(grpo.id)]
    assert len(rewards) == 3 and all(0.0 <= reward <= 1.0 for reward in rewards)
    page = log_in(browser, console, "alice")
    page.goto(f"{console.url}/#/jobs/{grpo.id}")
    page.wait_for_selector("[data-chart=objective] figcaption")
    shown = page.evaluate("[...document.querySelectorAll('[data-chart=objective] .numbers tbody tr')].map((tr) =>"
                          " [...tr.children].map((td) => td.textContent))")
    assert shown == [[str(step), page.evaluate(f"Number({r!r}).toPrecision(4)")] for step, r in zip((1, 2, 3), rewards,
                                                                                                    strict=True)], \
        shown
    sft = alice.submit(job_dict("alice-plain", console.data, 2), base_model=console.base)
    assert sft.wait(timeout=120).state == "completed"
    page.goto(f"{console.url}/#/jobs/{sft.id}")
    page.wait_for_selector("[data-chart=loss] figcaption")
    assert page.query_selector("[data-chart=objective]") is None
    # a completed job's adapter is tried too: read from its folder on a trainer holding its base, for the call only
    page.fill("#try-prompt", "Q: sql 3 and 9\nA:")
    page.fill("#try-tokens", "6")
    page.click(".try button[type=submit]")
    page.wait_for_selector("#try-base")
    answer = alice.generate(sft.id, "Q: sql 3 and 9\nA:", 6)   # greedy: the same continuation each time
    assert answer["step"] == 2 and "as it ended" in page.text_content(".try figcaption")
    assert page.text_content("#try-adapter") == (answer["adapter"] or ENDED_AT_ONCE)
    assert page.text_content("#try-base") == (answer["base"] or ENDED_AT_ONCE)
    page.close()
    # `aspen try` over the HTTP API: the same answer; a job with no adapter to try is refused, saying why
    monkeypatch.setenv("ASPEN_TOKEN", console.tokens["alice"])
    assert main(["try", sft.id, "Q: sql 3 and 9\nA:", "--max-new-tokens", "6", "--url", console.url, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["adapter"], printed["base"], printed["step"]) == (answer["adapter"], answer["base"], 2)
    waiting = alice.submit(job_dict("alice-waits", console.data, 2), base_model=NOBODYS_MODEL)
    assert main(["try", waiting.id, "hello", "--url", console.url]) != 0
    assert f"job {waiting.id} is queued: only a running job's adapter" in capsys.readouterr().err


def test_a_job_that_ended_without_an_adapter_is_not_promised_one(console, browser):
    """A job cancelled before it trained (queued for a base no trainer holds) has no adapter and will write none
    unless resumed: its page says so, not that one is "written to the output folder when the job ends"; the API's
    record (the reference) has it cancelled, with no adapter and no checkpoint."""
    alice = console.http("alice")
    job = alice.submit(job_dict("alice-never-trained", console.data, 2), base_model=NOBODYS_MODEL)
    alice.cancel(job.id)
    record = alice.status(job.id)
    assert record.state == "cancelled" and record.adapter_dir is None and record.checkpoint_step is None
    page = log_in(browser, console, "alice")
    page.goto(f"{console.url}/#/jobs/{job.id}")
    adapter_fact = ("[...document.querySelectorAll('#view dt')].find((dt) => dt.textContent === 'exported adapter')"
                    "?.nextElementSibling.textContent")
    page.wait_for_function(f"!!({adapter_fact})")   # the files' section is drawn
    said = page.evaluate(adapter_fact)
    assert said.startswith("none: the job cancelled before it wrote one; resume it"), said
    assert "when the job ends" not in page.inner_text("#view") and "checkpoint" not in said
    page.close()


HOLD_S = 20.0   # the trainer kept busy by a call of its own: a "try it" meanwhile waits queued for it


def test_a_try_it_is_withdrawn_when_replaced_or_when_the_user_leaves_the_jobs_page(console, browser, tmp_path):
    """The console's "try it" is a request of the page: a second one replaces the first, and leaving the job's page
    for another of the console (no tab closed, no reload) ends the one in flight; the service withdraws each (its
    ticket gone while the trainer is still busy; the scheduler's own wait is 90 s) and the trainer never runs them.
    Back on the page, a new one is answered, and nothing stale is shown."""
    from tests.helpers.try_it_probes import count_tries, hold_busy, tickets, trainer_handle

    alice = console.http("alice")
    job = alice.submit(job_dict("alice-tried", console.data, 100_000, checkpoint_every=100_000),
                       base_model=console.base)
    record = wait_for(lambda: (r := console.service.status(job.id)).state == "running" and r.step >= 1 and r,
                      timeout=180, what="the job to train", state=lambda: console.service.status(job.id))
    handle = trainer_handle(console.service, record.trainer)
    page = log_in(browser, console, "alice")
    try:
        assert count_tries(handle, on=True) == [] and tickets(console.service) == []
        page.goto(f"{console.url}/#/jobs/{job.id}")
        page.wait_for_selector("#try-prompt")
        busy = hold_busy(handle, tmp_path / "busy", HOLD_S, tmp_path / "free")
        wait_for((tmp_path / "busy").exists, timeout=60, what="the trainer to be busy")

        def generate(prompt: str) -> str:   # the "try it" sent from the page: its ticket, once at the scheduler
            before = set(tickets(console.service))
            page.fill("#try-prompt", prompt)
            page.fill("#try-tokens", "4")
            page.click(".try button[type=submit]")
            (ticket,) = wait_for(lambda: set(tickets(console.service)) - before, timeout=30,
                                 what=f"the \"try it\" {prompt!r} to reach the scheduler")
            return ticket

        first = generate("Q: first 1 and 3\nA:")
        second = generate("Q: second 1 and 3\nA:")   # replaces the first: that one withdrawn, this one waits
        wait_for(lambda: tickets(console.service) == [second], timeout=HOLD_S / 4, every=0.1,
                 what=f"the replaced \"try it\" {first} to be withdrawn")
        # what the page shows is the second's wait, not the first's end (aborted on purpose: nothing to say)
        assert page.text_content(".try-out").startswith("Generating between two steps"), page.text_content(".try-out")
        page.click("#nav a[href='#/trainers']")   # the user leaves the job's page, inside the console
        wait_for(lambda: tickets(console.service) == [], timeout=HOLD_S / 4, every=0.1,
                 what=f"the left page's \"try it\" {second} to be withdrawn")
        assert not ray.wait([busy], timeout=0)[0], "the trainer was free before the withdrawals were seen"
        (tmp_path / "free").touch()   # the trainer freed (not HOLD_S waited out)
        ray.get(busy, timeout=60)
        # back on the page: a new "try it" is answered; neither withdrawn one ran, nor is anything stale shown
        page.goto(f"{console.url}/#/jobs/{job.id}")
        page.wait_for_selector("#try-prompt")
        assert page.query_selector(".try-out *") is None
        page.fill("#try-prompt", "Q: third 1 and 3\nA:")
        page.fill("#try-tokens", "4")
        page.click(".try button[type=submit]")
        page.wait_for_selector("#try-base")
        reference = alice.generate(job.id, "Q: third 1 and 3\nA:", 4)
        assert page.text_content("#try-base") == (reference["base"] or ENDED_AT_ONCE)
        assert count_tries(handle, on=True) == ["Q: third 1 and 3\nA:"] * 2   # the page's and the reference's
    finally:
        (tmp_path / "free").touch()
        count_tries(handle, on=False)
        alice.cancel(job.id)
        page.close()


class WithRetiredTrainer:
    """The service's Ray client, whose description lists beside the service's own trainers one retired trainer."""

    def __init__(self, client: Client, retired: dict):
        self.client, self.retired = client, retired

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def info(self) -> dict:
        info = self.client.info()
        return {**info, "trainers": [*info["trainers"], self.retired]}


def retired_trainer(tmp_path: Path) -> dict:
    """A trainer as the service's fleet describes one whose node left the cluster and whose last reports wait for
    the job table (it is listed until they are in: actors/service/scheduler/trainer_fleet.py, drop_retired): a real
    TrainerFleet over the fake cluster of tests/helpers/fleet_fakes.py, whose worker node dies."""
    from actors.service.scheduler.trainer_fleet import TrainerUnavailable
    from tests.helpers.fleet_fakes import HEAD, WORKER, FakeCluster, bring_up, fleet_with

    cluster = FakeCluster(HEAD, WORKER)
    fleet, _, _, _, _ = fleet_with(tmp_path, cluster, trainer="trainer-1")
    bring_up(fleet, cluster)
    lost = cluster.current("trainer-1")
    cluster.live = [HEAD]
    lost.polls[-1].fail(TrainerUnavailable("ActorUnavailableError", "node died"))
    fleet.watch_all()
    retired = next(t for t in fleet.describe() if t["retired"])
    return {**retired, "id": "trainer-gone"}   # not one of the service's own ids


def test_a_retired_trainer_is_shown_retired_not_starting(console, browser, tmp_path):
    """The Trainers page shows each trainer's state as the service's description has it: the service's own trainer
    ready, a retired one (its node left the cluster) retired, not "starting" as before. The page reads the real HTTP
    API over the real service, whose description gains the retired trainer its fleet would list."""
    retired = retired_trainer(tmp_path / "fleet")
    token = ensure_token(tmp_path / "http-token")
    with running_server(create_app(ServiceLink(client=WithRetiredTrainer(console.service, retired)), token)) as url:
        trainers = {t["id"]: t for t in HttpClient(url, token).info()["trainers"]}   # the reference: the API's JSON
        assert trainers["trainer-gone"]["retired"] and not trainers["trainer-gone"]["ready"]
        assert trainers["trainer-gone"]["phase"] == "retired"
        own = next(t for t in trainers.values() if not t["retired"])
        assert own["ready"]
        page = log_in_at(browser, url, token)
        page.goto(f"{url}/#/trainers")
        page.wait_for_selector('[data-trainer="trainer-gone"]')

        def state(trainer_id: str) -> str:
            facts = page.query_selector(f'[data-trainer="{trainer_id}"] dl')
            terms = [e.text_content() for e in facts.query_selector_all("dt")]
            return [e.text_content() for e in facts.query_selector_all("dd")][terms.index("state")]

        assert state("trainer-gone").startswith("retired"), state("trainer-gone")
        assert state(own["id"]) == "ready"
        shot(page, console, "trainers-retired")
        page.close()
