"""The embedded MQTT broker (amqtt, installed with the `broker` extra): its accounts' password file, the
plugins that admit only those accounts and let only the service publish, and its configuration. Imported
only when the service starts the embedded broker (`orchestrator.mqtt_events`)."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from amqtt.plugins.authentication import FileAuthPlugin
from amqtt.plugins.topic_checking import TopicAccessControlListPlugin
from amqtt.session import Session

from actors.engine.durable import write_durably
from orchestrator.mqtt_settings import PASSWORD_FILE, BrokerCredentials, _is_private

log = logging.getLogger(__name__)


def _password_hasher() -> Any:
    from pwdlib import PasswordHash
    from pwdlib.hashers.argon2 import Argon2Hasher

    return PasswordHash((Argon2Hasher(),))


def write_password_file(state_dir: str | Path, credentials: BrokerCredentials) -> Path:
    """`<state_dir>/mqtt-passwords` for amqtt's FileAuthPlugin: `username:<argon2 hash>` per account, mode
    0600. An existing file that is private and holds exactly these accounts with matching hashes is kept."""
    path = Path(state_dir).expanduser() / PASSWORD_FILE
    accounts = {a.username: a.password for a in (credentials.service, credentials.reader)}
    hasher = _password_hasher()
    try:
        with path.open(encoding="utf-8") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            lines = [line.strip() for line in handle if line.strip() and not line.startswith("#")]
    except FileNotFoundError:
        pass
    else:
        stored = dict(line.split(":", 1) for line in lines if ":" in line)
        if _is_private(mode) and len(stored) == len(lines) and stored.keys() == accounts.keys():
            try:
                if all(hasher.verify(accounts[user], stored[user]) for user in accounts):
                    return path
            except Exception as error:  # noqa: BLE001 - pwdlib's errors for a malformed hash; the file is rewritten
                log.info("events: %s has an unreadable hash (%r); writing it again", path, error)
    hashes = "".join(f"{user}:{hasher.hash(password)}\n" for user, password in accounts.items())
    write_durably(path, hashes, private=True)
    return path


def may_publish(acl: dict[str, list[str]], username: str | None, topic: str) -> bool:
    """Whether `acl` (username -> topic filters) lets `username` publish on `topic`."""
    return any(TopicAccessControlListPlugin.topic_ac(topic, allowed) for allowed in acl.get(username or "", []))


class AccountsAuthPlugin(FileAuthPlugin):
    """amqtt's FileAuthPlugin (accounts and argon2 hashes from `password_file`), with the hash checked off
    the broker's event loop, connections without a username refused, and a last will refused on a topic
    that `publish_acl` does not let the account publish on (amqtt publishes and retains a will without
    asking the topic ACL: a reader could otherwise leave a retained `completed` state on disconnect)."""

    @dataclass
    class Config:
        password_file: str | Path | None = None
        publish_acl: dict[str, list[str]] = field(default_factory=dict)

    async def authenticate(self, *, session: Session) -> bool:
        username = session.username if session else None
        if not username:
            log.info("events: refused an MQTT connection without credentials")
            return False
        stored = self._users.get(username)
        if stored is None or not await asyncio.to_thread(self.pwd_hasher.verify, session.password or "", stored):
            log.info("events: refused an MQTT connection as '%s': unknown account or wrong password", username)
            return False
        if session.will_flag and not may_publish(self.config.publish_acl, username, session.will_topic or ""):
            log.info("events: refused an MQTT connection as '%s': its last will is on '%s', where it may not "
                     "publish", username, session.will_topic)
            return False
        return True


class TopicAclPlugin(TopicAccessControlListPlugin):
    """amqtt's TopicAccessControlListPlugin with its options spelled `publish_acl` and `subscribe_acl` (amqtt
    0.12's own Config only knows the deprecated `acl` for subscriptions and warns about it)."""

    @dataclass
    class Config:
        publish_acl: dict[str, list[str]] = field(default_factory=dict)
        subscribe_acl: dict[str, list[str]] = field(default_factory=dict)


def embedded_broker_config(port: int, password_file: Path, credentials: BrokerCredentials,
                           topic_prefix: str) -> dict[str, Any]:
    """The amqtt broker configuration: one TCP listener on 127.0.0.1:`port`, only the generated accounts,
    only the service publishing (under the prefix), the service and the reader subscribing to it."""
    topics = [f"{topic_prefix}/#"]
    publish_acl = {credentials.service.username: topics}
    subscribe_acl = {credentials.service.username: topics, credentials.reader.username: topics}
    return {"listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}"}},
            "plugins": {f"{__name__}.AccountsAuthPlugin": {"password_file": str(password_file),
                                                           "publish_acl": publish_acl},
                        f"{__name__}.TopicAclPlugin": {"publish_acl": publish_acl, "subscribe_acl": subscribe_acl}}}
