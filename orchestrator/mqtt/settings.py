"""Where the job events are and who may read them: broker URLs, the embedded broker's generated accounts
(`<state_dir>/mqtt-credentials.json`, mode 0600: the service's, the only one that may publish, and a
reader's) and the settings file a subscriber reads (`<state_dir>/mqtt-reader.json`)."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

from actors.storage.durable import write_durably

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
    account, the topic prefix, and the file they were read from."""

    topic_prefix: str = "aspen/v1"
    source: Path | None = None


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
    return EventSettings(address.host, address.port, address.tls, address.username, address.password,
                         topic_prefix=prefix, source=path)
