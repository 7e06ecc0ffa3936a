"""`aspen watch`: a live table of the service's jobs (state, step, loss, tokens/s, ETA), refreshed every
second from the service's job table, or printed once (`--once`); or (`--events`) one line per job state
change and event as the service publishes them over MQTT, read with the embedded broker's read-only
account (`orchestrator.mqtt.settings.reader_settings`), or as the service's YAML says
(`config_settings`); over TLS for mqtts://, as the service connects (`tls_context`)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from actors.service.table.job_record import best_text
from actors.service.table.job_table import JobRecord
from orchestrator import strict_json
from orchestrator.mqtt.client_log import AtDebug
from orchestrator.mqtt.settings import READER_FILE, tls_context

if TYPE_CHECKING:
    from orchestrator.mqtt.settings import EventSettings


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def format_duration(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def eta_seconds(record: JobRecord, now: float | None = None) -> float | None:
    """Seconds until a running job reaches its total steps: from its tokens/s and tokens per step, else
    from its steps per second since it started. None when it is not running or nothing is measured yet."""
    if record.state != "running" or not record.total_steps or not record.step:
        return None
    remaining = max(record.total_steps - record.step, 0)
    if record.tokens_per_s and record.tokens:
        return remaining * (record.tokens / record.step) / record.tokens_per_s
    if record.started_at:
        elapsed = (now or time.time()) - record.started_at
        if elapsed > 0:
            return remaining / (record.step / elapsed)
    return None


def jobs_table(records: list[JobRecord], now: float | None = None, title: str | None = None) -> Table:
    table = Table(title=title or f"aspen jobs ({time.strftime('%H:%M:%S', time.localtime(now or time.time()))})")
    scored = any(r.eval_score is not None for r in records)   # a job with an eval_generate metric
    kept = any(r.best is not None for r in records)   # a keep_best job evaluated: its best so far, or the kept one
    for column, right in (("job", False), ("state", False), ("step", True), ("loss", True), ("eval loss", True),
                          *([("eval score", True)] if scored else []), *([("best (kept)", False)] if kept else []),
                          ("tokens/s", True), ("ETA", True), ("reason", False)):
        table.add_column(column, justify="right" if right else "left", overflow="fold")
    for r in records:
        eta = eta_seconds(r, now)
        table.add_row(r.id, r.state, f"{r.step}/{r.total_steps or '?'}", _fmt(r.loss), _fmt(r.eval_loss),
                      *([_fmt(r.eval_score)] if scored else []),
                      *([best_text(r.best)] if kept else []),
                      _fmt(r.tokens_per_s, ".0f") if r.state == "running" else "-",
                      format_duration(eta) if eta is not None else "-", escape(r.reason))   # text, not markup
    return table


def watch(fetch: Callable[[], list[JobRecord]], *, once: bool = False, interval: float = 1.0,
          console: Console | None = None, duration: float | None = None) -> list[JobRecord]:
    """Show the jobs `fetch` returns: once, or live every `interval` seconds until Ctrl-C (or `duration`
    seconds). Returns the last records fetched."""
    console = console or Console()
    records = fetch()
    if once:
        console.print(jobs_table(records))
        return records
    deadline = None if duration is None else time.time() + duration
    with Live(jobs_table(records), console=console, refresh_per_second=4) as live:
        try:
            while deadline is None or time.time() < deadline:
                time.sleep(interval)
                records = fetch()
                live.update(jobs_table(records))
        except KeyboardInterrupt:
            pass
    return records


# -- aspen watch --events --------------------------------------------------------------------------------------
def _clock(payload: dict[str, Any]) -> str:
    when = payload.get("time")
    return time.strftime("%H:%M:%S", time.localtime(when if isinstance(when, (int, float)) else time.time()))


def _details(payload: dict[str, Any], skip: tuple[str, ...]) -> str:
    """The payload's other fields (not its `publisher` and `seq`, which tell repeats apart)."""
    return "".join(f"  {key} {value}" for key, value in payload.items()
                   if key not in skip and key not in ("publisher", "seq") and value is not None)


def event_line(topic: str, payload: bytes, retained: bool, prefix: str = "aspen/v1") -> str:
    """One line for a message of the service's topics (see `orchestrator.mqtt.topics`); `retained` marks what
    the broker kept from before (the current state when the watch starts)."""
    text = payload.decode("utf-8", errors="replace")
    if not text:   # an empty retained message: the broker's copy was cleared (a job deleted or past retention)
        return f"{time.strftime('%H:%M:%S')}  {topic}  (retained state cleared)"
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        return f"{time.strftime('%H:%M:%S')}  {topic}  {text}"
    levels = topic[len(prefix) + 1:].split("/") if topic.startswith(prefix + "/") else topic.split("/")
    mark = " (retained)" if retained else ""
    if levels == ["service", "status"]:
        return f"{_clock(data)}  service {data.get('state')}{mark}" + _details(data, ("state", "time"))
    if len(levels) == 3 and levels[0] == "jobs":
        job, kind = data.get("job") or levels[1], levels[2]
        if kind == "state":
            name = f" ({data['name']})" if data.get("name") else ""
            change = data.get("state") if retained or not data.get("previous") else \
                f"{data['previous']} -> {data.get('state')}"
            step = f"step {data.get('step')}/{data.get('total_steps') or '?'}"
            loss = f"  loss {data['loss']:.4f}" if isinstance(data.get("loss"), (int, float)) else ""
            reason = f"  {data['reason']}" if data.get("reason") else ""
            return f"{_clock(data)}  {job}{name}  {change}{mark}  {step}{loss}{reason}"
        if kind == "events":
            return f"{_clock(data)}  {job}  {data.get('kind')}{mark}" + _details(data, ("job", "kind", "time"))
        if kind == "progress":
            return f"{_clock(data)}  {job}  progress" + _details(data, ("job", "time"))
    return f"{_clock(data)}  {topic}{mark}  {text}"


def event_json(topic: str, payload: bytes, retained: bool) -> str:
    """One message as one JSON object on a line: {"topic", "retained", "payload"} (the payload parsed from
    JSON where it is JSON, else its text; an empty payload, a cleared retained message, is null)."""
    text = payload.decode("utf-8", errors="replace")
    try:
        data: Any = json.loads(text) if text else None
    except ValueError:
        data = text
    return strict_json.dumps({"topic": topic, "retained": retained, "payload": data})


RECONNECT_FOR_S = 300.0                  # `aspen watch --events --reconnect-for`'s default
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 5.0    # between attempts to reach a broker that went away
SEEN_KEPT = 100_000                      # the messages remembered to leave out their repeats


class Repeats:
    """Tells a message the watcher printed already (QoS 1 may deliver one again after a reconnect, the
    broker sends the retained states again at each subscription, and the service publishes every job's last
    state again at each of its connects) by its (topic, `publisher`, `seq`) (`orchestrator.mqtt.topics`):
    the last SEEN_KEPT messages, and each topic's last one. A message without them (another publisher's)
    is never a repeat."""

    def __init__(self, kept: int = SEEN_KEPT):
        self.kept = kept
        self.recent: OrderedDict[tuple[str, str, int], None] = OrderedDict()
        self.last: dict[str, tuple[str, str, int]] = {}   # topic -> its last message's key

    def repeated(self, topic: str, payload: bytes) -> bool:
        """Whether the message was seen already; remembers it where not. A clearing (an empty payload)
        right after another on its topic is a repeat (nothing was set between them)."""
        if not payload:
            cleared = (topic, "", -1)
            repeated = self.last.get(topic) == cleared
            self.last[topic] = cleared
            return repeated
        try:
            data = json.loads(payload) if payload else None
        except ValueError:
            return False
        if not isinstance(data, dict) or not isinstance(data.get("seq"), int) or "publisher" not in data:
            return False
        key = (topic, str(data["publisher"]), data["seq"])
        if key in self.recent or self.last.get(topic) == key:
            return True
        self.recent[key] = None
        if len(self.recent) > self.kept:
            self.recent.popitem(last=False)
        self.last[topic] = key
        return False


class _Following:
    """How `_follow_events` goes: this watch's client id (one session for all its connections), since when
    the broker is away (None while connected), the last error, the repeats to leave out."""

    def __init__(self) -> None:
        self.identifier = f"aspen-watch-{uuid.uuid4().hex}"   # unguessable: amqtt lets an id's claimant end its session
        self.connected_once = False
        self.connected_now = False
        self.away_since: float | None = None
        self.error: str = ""
        self.repeats = Repeats()


MQTT_LOG = logging.getLogger("orchestrator.watch.mqtt")   # shown with `aspen --debug watch --events`


def _tls_problem(settings: EventSettings, error: Exception) -> str | None:
    """What to say where the connection failed in its TLS handshake (a certificate that does not verify,
    a listener without TLS), naming the setting and the fix; None for any other error."""
    text = str(error)
    checked = f"{settings.ca_file} ({settings.ca_setting})" if settings.ca_file else \
        f"the system's CAs ({settings.ca_setting} not set)"
    if "CERTIFICATE_VERIFY_FAILED" in text:
        reason = text.split("certificate verify failed:")[-1].split("(_ssl")[0].strip(" :")
        return (f"the certificate of the MQTT broker at {settings.url} does not verify ({reason}) against "
                f"{checked}: set {settings.ca_setting} to the PEM file of the CA that signed the broker's "
                f"certificate for {settings.host} (the one the service's events.ca_file names)")
    if "[SSL" in text:
        return (f"the TLS handshake with the MQTT broker at {settings.url} failed ({text}): is that port the "
                "broker's TLS listener? (mqtts:// is TLS, mqtt:// is not; the service's events.broker says which)")
    return None


def _session_client(settings: EventSettings, identifier: str, *, keep: bool) -> Any:
    """An aiomqtt client (MQTT 3.1.1) whose session the broker keeps while it is away (`keep`: clean_session
    False) or ends (clean_session True), with `session_present` from the broker's CONNACK; over TLS for
    mqtts:// (checked as the service checks it: `tls_context`)."""
    from orchestrator.mqtt.handshake import HandshakeClient

    class SessionClient(HandshakeClient):
        session_present = False

        def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any,
                        properties: Any = None) -> None:
            self.session_present = bool(getattr(flags, "session_present", False))
            super()._on_connect(client, userdata, flags, reason_code, properties)

    return SessionClient(settings.host, settings.port, username=settings.username, password=settings.password,
                         identifier=identifier, clean_session=not keep, timeout=10, logger=AtDebug(MQTT_LOG),
                         tls_context=tls_context(settings.tls, settings.ca_file, settings.ca_setting))


async def _end_session(settings: EventSettings, identifier: str) -> None:
    """Leaving: connect once more with a clean session, so that the broker drops this watch's session (MQTT
    3.1.1 sessions do not expire) rather than queue messages for it. Quietly nothing where it cannot."""
    import aiomqtt

    try:
        async with _session_client(settings, identifier, keep=False):
            pass
    except (aiomqtt.MqttError, OSError):   # OSError: a timeout too
        pass


async def _follow_events(settings: EventSettings, out: Callable[[str], None], progress: bool,
                         stop: threading.Event | None, as_json: bool = False, *,
                         reconnect_for: float = RECONNECT_FOR_S, say: Callable[[str], None] | None = None) -> None:
    """Follow the events in one broker session (the broker queues the QoS 1 messages while the watcher is
    away and sends them when it is back); where the broker goes away after the first connect (restarted,
    the service restarting), say so, reconnect with backoff and say when it is back and whether it kept the
    session; give up (ConnectionError) after `reconnect_for` seconds without it. A first connect that fails
    raises at once. Leaving, the session is ended."""
    following = _Following()
    try:
        await _reconnecting(settings, out, progress, stop, as_json, following, reconnect_for,
                            say or (lambda line: print(f"aspen: {line}", file=sys.stderr, flush=True)))
    finally:
        if following.connected_now:
            await _end_session(settings, following.identifier)


async def _reconnecting(settings: EventSettings, out: Callable[[str], None], progress: bool,
                        stop: threading.Event | None, as_json: bool, following: _Following, reconnect_for: float,
                        say: Callable[[str], None]) -> None:
    import aiomqtt

    where = settings.url + (f" as '{settings.username}'" if settings.username else "") + \
        (f" (from {settings.source})" if settings.source else "")
    backoff = BACKOFF_MIN_S
    while True:
        try:
            await _follow_once(settings, out, progress, stop, as_json, following, say)
            return    # `stop` was set
        except aiomqtt.MqttError as error:
            following.connected_now = False
            problem = _tls_problem(settings, error)
            if problem:    # retrying will not help
                raise ConnectionError(problem) from None
            if not following.connected_once:
                embedded = settings.source is not None and settings.source.name == READER_FILE
                raise ConnectionError(f"cannot follow the job events at {where}: {error}. " + (
                    "Is the service running (with the embedded broker), and are these its current credentials?"
                    if embedded else "Is the broker running there, and does it admit this account?")) from None
            following.error = str(error)
        now = time.monotonic()
        if following.away_since is None:
            following.away_since, backoff = now, BACKOFF_MIN_S
            say(f"the MQTT broker at {settings.url} went away ({following.error}); reconnecting with backoff, "
                f"for {reconnect_for:.0f} s at most (--reconnect-for). It keeps this watch's session meanwhile: "
                "what the service publishes comes when the broker returns, unless it restarts without "
                "persistence")
        elif now - following.away_since >= reconnect_for:
            raise ConnectionError(f"the MQTT broker at {where} has been away for {now - following.away_since:.0f} s "
                                  f"(--reconnect-for {reconnect_for:g}); last error: {following.error}. Is the "
                                  "service running? Run aspen watch --events again once it is") from None
        deadline = min(now + backoff, following.away_since + reconnect_for)
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            await asyncio.sleep(0.1)
        if stop is not None and stop.is_set():
            return
        backoff = min(backoff * 2, BACKOFF_MAX_S)


def _say_back(settings: EventSettings, following: _Following, session_kept: bool, say: Callable[[str], None]) -> None:
    assert following.away_since is not None
    back = f"the MQTT broker at {settings.url} is back after {time.monotonic() - following.away_since:.0f} s"
    if session_kept:
        say(f"{back} and kept this watch's session: what was published meanwhile follows, in order (repeats "
            "left out)")
    else:
        say(f"{back} without this watch's session (a broker restarted without persistence, e.g. mosquitto's "
            "persistence false, loses it): state changes and events published while the watch was away may be "
            "missed; the current states come again, marked retained (those printed already left out)")
    following.away_since = None


async def _follow_once(settings: EventSettings, out: Callable[[str], None], progress: bool,
                       stop: threading.Event | None, as_json: bool, following: _Following,
                       say: Callable[[str], None]) -> None:
    """One connection: subscribe, print until `stop` is set (returns) or the connection ends (MqttError)."""
    prefix = settings.topic_prefix
    topics = [f"{prefix}/service/status", f"{prefix}/jobs/+/state", f"{prefix}/jobs/+/events"]
    if progress:
        topics.append(f"{prefix}/jobs/+/progress")
    async with _session_client(settings, following.identifier, keep=True) as client:
        following.connected_now = True
        for topic in topics:    # again where the session was kept: the broker's grant is checked each time
            granted = await client.subscribe(topic, qos=1)
            if any(getattr(code, "is_failure", False) or code == 0x80 for code in granted):
                raise PermissionError(f"the broker at {settings.url} as '{settings.username}' refused the "
                                      f"subscription to {topic}: is that the service's reader account and topic "
                                      "prefix?")
        following.connected_once = True
        if following.away_since is not None:
            _say_back(settings, following, client.session_present, say)
        reader = asyncio.create_task(_print_messages(client, out, prefix, as_json, following.repeats))
        try:
            while not reader.done() and not (stop is not None and stop.is_set()):
                await asyncio.wait({reader}, timeout=0.1)
        finally:   # also on Ctrl-C (this task cancelled): the reader ends before the connection closes
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        if not reader.cancelled():
            reader.result()


async def _print_messages(client: Any, out: Callable[[str], None], prefix: str, as_json: bool,
                          repeats: Repeats) -> None:
    import aiomqtt

    async for message in client.messages:
        topic, payload, retained = str(message.topic), bytes(message.payload), bool(message.retain)
        if repeats.repeated(topic, payload):
            continue
        out(event_json(topic, payload, retained) if as_json else event_line(topic, payload, retained, prefix))
    raise aiomqtt.MqttError("the broker closed the connection (the service stopped?)")


def watch_events(settings: EventSettings, *, out: Callable[[str], None] | None = None, progress: bool = False,
                 stop: threading.Event | None = None, as_json: bool = False,
                 reconnect_for: float = RECONNECT_FOR_S) -> None:
    """Print (`out`, default: print and flush) one line per job state change, job event and service status
    the service publishes, from the retained current ones on, until Ctrl-C (returns quietly) or `stop` is
    set, each message once (repeats, told by their `seq`, left out). A broker that goes away after the first
    connect is reconnected to with backoff, in the same session (said on stderr, and whether the broker kept
    it: then what was published meanwhile comes); raises ConnectionError when the first connect fails, the
    broker's certificate does not verify or the broker stays away `reconnect_for` seconds, PermissionError
    when it refuses the subscription, ValueError when the CA file is missing."""
    out = out or (lambda line: print(line, flush=True))
    tls_context(settings.tls, settings.ca_file, settings.ca_setting)   # a missing or bad CA file: said first
    try:
        asyncio.run(_follow_events(settings, out, progress, stop, as_json, reconnect_for=reconnect_for))
    except KeyboardInterrupt:
        pass
