"""Where the job events are and who may read them: broker URLs, the TLS they are reached with (`tls_context`,
the service's publisher and `aspen watch --events` alike), the embedded broker's generated accounts
(`<state_dir>/mqtt-credentials.json`, mode 0600: the service's, the only one that may publish, and a
reader's) and what a subscriber reads: the settings file (`<state_dir>/mqtt-reader.json`) or the service's
YAML (`config_settings`)."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import ssl
import stat
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

from actors.storage.durable import write_durably
from orchestrator.mqtt.topics import topic_prefix

log = logging.getLogger(__name__)

ACCOUNT_NAME = re.compile(r"[A-Za-z0-9._-]+")
CREDENTIALS_FILE = "mqtt-credentials.json"
PASSWORD_FILE = "mqtt-passwords"
READER_FILE = "mqtt-reader.json"
SERVICE_ACCOUNT = "aspen-service"
READER_ACCOUNT = "aspen-reader"


@dataclass(frozen=True)
class BrokerAddress:
    """Where to publish: host, port, TLS, credentials."""

    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """The broker's URL without credentials (safe to show)."""
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


def parse_broker_url(url: str, username: str | None = None, password: str | None = None) -> BrokerAddress:
    """`mqtt://host[:1883]` or `mqtts://host[:8883]`, optionally with `user:password@`; the config's
    `username`/`password` win over the URL's."""
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
        raise ValueError(f"events.broker: '{url}' is neither 'embedded' nor a broker URL like mqtt://host:1883 "
                         "or mqtts://host:8883")
    tls = parts.scheme == "mqtts"
    try:
        port = parts.port or (8883 if tls else 1883)
    except ValueError:
        raise ValueError(f"events.broker: '{url}' has an invalid port") from None
    return BrokerAddress(parts.hostname, port, tls,
                         username if username is not None else (unquote(parts.username) if parts.username else None),
                         password if password is not None else (unquote(parts.password) if parts.password else None))


# -- the embedded broker's accounts ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Account:
    username: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class BrokerCredentials:
    """The embedded broker's two accounts: `service` publishes, `reader` only subscribes."""

    service: Account
    reader: Account


@dataclass(frozen=True)
class EventSettings(BrokerAddress):
    """What a subscriber needs to follow the service's job events: the broker's address, the reader
    account, the topic prefix, the file they were read from, and for mqtts:// the CA file its certificate
    is checked against (None: the system's CAs) with the setting that named it (`ca_setting`, for errors)."""

    topic_prefix: str = "aspen/v1"
    source: Path | None = None
    ca_file: Path | None = None
    ca_setting: str = "ca_file"


def tls_context(tls: bool, ca_file: Path | None, setting: str) -> ssl.SSLContext | None:
    """The TLS context of an mqtts:// broker (None for mqtt://): its certificate and host name verified
    against `ca_file`, else against the system's CAs. The service's publisher and `aspen watch --events`
    connect alike. ValueError naming `setting` (e.g. `events.ca_file`) where the file is missing or holds
    no CA certificate."""
    if not tls:
        return None
    if ca_file is None:
        return ssl.create_default_context()
    try:
        return ssl.create_default_context(cafile=str(ca_file))
    except FileNotFoundError:
        raise ValueError(f"{setting}: {ca_file} does not exist; set it to the PEM file of the CA that signed the "
                         "broker's certificate, or leave it out to check it against the system's CAs") from None
    except (ssl.SSLError, OSError) as error:
        raise ValueError(f"{setting}: {ca_file} is not a readable PEM CA certificate ({error}); set it to the PEM "
                         "file of the CA that signed the broker's certificate") from None


def _is_private(mode: int) -> bool:
    return not mode & (stat.S_IRWXG | stat.S_IRWXO)


def _new_credentials() -> BrokerCredentials:
    return BrokerCredentials(Account(SERVICE_ACCOUNT, secrets.token_urlsafe(32)),
                             Account(READER_ACCOUNT, secrets.token_urlsafe(32)))


def _parse_credentials(path: Path, text: str) -> BrokerCredentials:
    try:
        data = json.loads(text)
        accounts = [Account(str(data[role]["username"]), str(data[role]["password"])) for role in ("service", "reader")]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a valid MQTT credentials file ({error!r}); delete it and restart the "
                         "service to get new credentials (subscribers then read the new reader account)") from None
    if not all(ACCOUNT_NAME.fullmatch(account.username) and account.password and "\n" not in account.password
               for account in accounts) or accounts[0].username == accounts[1].username:
        raise ValueError(f"{path}: the service and reader accounts need distinct usernames of letters, digits, '.', "
                         "'_' and '-', and non-empty one-line passwords; delete the file and restart the service to "
                         "get new credentials")
    return BrokerCredentials(*accounts)


def broker_credentials(state_dir: str | Path) -> BrokerCredentials:
    """The embedded broker's accounts from `<state_dir>/mqtt-credentials.json`, made there (mode 0600,
    random passwords) on first use and reused after, so that subscribers' settings survive restarts. A file
    that others could read is replaced by new credentials (its passwords may be known), with a warning."""
    path = Path(state_dir).expanduser() / CREDENTIALS_FILE
    try:
        with path.open(encoding="utf-8") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            text = handle.read()
    except FileNotFoundError:
        credentials = _new_credentials()
    else:
        if _is_private(mode):
            return _parse_credentials(path, text)
        log.warning("events: %s was readable or writable by others (mode %o); the MQTT accounts get new passwords "
                    "(subscribers read them again from %s)", path, stat.S_IMODE(mode), path.with_name(READER_FILE))
        credentials = _new_credentials()
    write_durably(path, json.dumps({
        "version": 1,
        "service": {"username": credentials.service.username, "password": credentials.service.password},
        "reader": {"username": credentials.reader.username, "password": credentials.reader.password}}, indent=1) + "\n",
        private=True)
    return credentials


def write_reader_settings(state_dir: str | Path, address: BrokerAddress, topic_prefix: str, reader: Account) -> Path:
    """`<state_dir>/mqtt-reader.json` (mode 0600 when written): the broker's URL, the topic prefix and the
    reader account. Left untouched when it already says the same (so a mode the operator gave it stays)."""
    path = Path(state_dir).expanduser() / READER_FILE
    text = json.dumps({"url": address.url, "topic_prefix": topic_prefix, "username": reader.username,
                       "password": reader.password}, indent=1) + "\n"
    try:
        if path.read_text(encoding="utf-8") == text:
            return path
    except FileNotFoundError:
        pass
    write_durably(path, text, private=True)
    return path


def reader_settings(state_dir: str | Path) -> EventSettings:
    """The embedded broker's address and read-only account, from the service's state dir (the file the
    service writes when its broker starts). Raises FileNotFoundError / PermissionError / ValueError with
    what to do."""
    folder = Path(state_dir).expanduser()
    path = folder / READER_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"the service's MQTT credentials are not in {folder} (no {READER_FILE}): is the "
                                "service running with the embedded broker (events.broker: embedded), and can you "
                                "read its state dir?") from None
    except PermissionError:
        raise PermissionError(f"cannot read the service's MQTT credentials ({path}): run as the service's user, or "
                              f"have its owner share that file with you (e.g. chmod g+r {path})") from None
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); restart the service to write it again") from None
    try:
        address = parse_broker_url(str(data["url"]), str(data["username"]), str(data["password"]))
        prefix = str(data.get("topic_prefix") or "aspen/v1")
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path} lacks the broker's url, username or password ({error!r}); restart the service "
                         "to write it again") from None
    ca_file = data.get("ca_file")   # mqtts:// only; relative to the file's folder
    return EventSettings(address.host, address.port, address.tls, address.username, address.password,
                         topic_prefix=prefix, source=path,
                         ca_file=folder / Path(ca_file).expanduser() if ca_file else None,
                         ca_setting=f"ca_file in {path}")


def service_settings(info: dict) -> EventSettings:
    """The reader settings of the service whose `Client.info()` this is (from its state dir); for a
    service publishing to an external broker (no reader account of its own), FileNotFoundError saying to
    follow it with the service's YAML (`config_settings`)."""
    try:
        return reader_settings(info["state_dir"])
    except FileNotFoundError:
        if info.get("mqtt_url") and not info.get("mqtt_credentials"):   # no reader account: not the embedded
            raise FileNotFoundError(
                f"the service publishes its job events to the external broker {info['mqtt_url']}, whose accounts "
                "are the operator's: follow it with `aspen watch --events --config SERVICE_YAML` (the service's "
                "YAML: its events: broker, account and ca_file)") from None
        raise


def config_settings(config_file: str | Path) -> EventSettings:
    """The broker the service publishes to, as its YAML (`aspen serve --config`) says: its `events:` broker
    URL, account, `ca_file` and topic prefix, so that a subscriber connects as the service does; with
    `broker: embedded`, the reader account from the YAML's state_dir (`reader_settings`). ValueError /
    FileNotFoundError naming the file and the field."""
    import yaml
    from pydantic import ValidationError

    from actors.service.scheduler.config import EventsConfig
    from orchestrator.service_yaml import resolve_service_paths

    path = Path(config_file).expanduser()
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise FileNotFoundError(f"the service's YAML {path} does not exist: give the file `aspen serve --config` "
                                "was started with") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path} is not valid YAML ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a service YAML (a mapping with `events:`, `state_dir:`, ...)")
    resolve_service_paths(data, path)   # its relative paths from its folder, as `aspen serve --config` reads them
    try:
        events = EventsConfig.model_validate(data.get("events") or {})
    except ValidationError as error:
        raise ValueError(f"{path}: events: {error}") from None
    if not events.enabled:
        raise ValueError(f"{path} has events.enabled: false: that service publishes no job events")
    if events.broker == "embedded":
        return reader_settings(data.get("state_dir") or "~/.aspen")
    address = parse_broker_url(events.broker, events.username, events.password)
    return EventSettings(address.host, address.port, address.tls, address.username, address.password,
                         topic_prefix=topic_prefix(events.topic_prefix), source=path, ca_file=events.ca_file,
                         ca_setting=f"events.ca_file in {path}")
