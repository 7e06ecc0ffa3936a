"""The embedded MQTT broker (amqtt, the `broker` extra) behind a listening socket of our own, and its accounts.

Its accounts' password file, the plugins that admit only those accounts and let only the service publish,
its configuration, and `EmbeddedBroker`. Imported only when the service starts the embedded broker
(`orchestrator.mqtt.connection`).

The embedded broker admits only the accounts the service generates (random passwords, kept in the
service's state dir, all files mode 0600, reused across restarts):
    mqtt-credentials.json  {"version": 1, "service": {"username", "password"}, "reader": {...}}: the
                           service's publisher account and the subscribers' read-only account
    mqtt-passwords         `username:<argon2 hash>` lines, amqtt's FileAuthPlugin reads them
    mqtt-reader.json       {"url", "topic_prefix", "username", "password"}: what a subscriber needs (the
                           reader account and the running broker's address; see `reader_settings`),
                           written when the broker starts. It holds no publisher secret, so it is the
                           file to share (e.g. `chmod g+r`) with people who may watch the jobs.
Anonymous connections are refused; only the service account may publish (under the topic prefix), the
reader and the service may subscribe to the prefix (amqtt's TopicAccessControlListPlugin). A publish
that the ACL refuses is acknowledged by the broker but dropped: nobody receives it, nothing is retained.

On a shared service (`<state_dir>/users.json`, `aspen user add`) each user is an account too: username
their user name, password their API token, checked against the users file as it is now (read again when
it changes: a removed user or a rotated token is refused from the next connection on, and a removed
user's open session receives nothing more). A user may subscribe only under `<prefix>/users/<name>/`
(where the service publishes their own jobs a second time: `orchestrator/mqtt/topics.py`) and to the
service's status; an admin under the whole prefix; no user may publish."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from amqtt.adapters import StreamReaderAdapter, StreamWriterAdapter
from amqtt.broker import Broker
from amqtt.contexts import Action
from amqtt.plugins.authentication import FileAuthPlugin
from amqtt.plugins.topic_checking import TopicAccessControlListPlugin
from amqtt.session import Session

from actors.service.accounts.users import User, UserBook, UsersFileError
from actors.storage.durable import write_durably
from orchestrator.mqtt.settings import PASSWORD_FILE, BrokerCredentials, _is_private

log = logging.getLogger(__name__)

LISTENER = "default"   # the broker's one listener, whose socket EmbeddedBroker holds


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


class UserAccounts:
    """The service's users as broker accounts (`<state_dir>/users.json`, read again when it changes), and the
    topics each may read."""

    def __init__(self, users_file: str | Path, topic_prefix: str):
        self.book = UserBook(users_file)
        self.prefix = topic_prefix

    def user(self, username: str | None) -> User | None:
        """The user of that name as the file holds it now (None: no such user, or the file unreadable)."""
        if not username:
            return None
        try:
            return next((user for user in self.book.users() if user.name == username), None)
        except (OSError, UsersFileError) as error:
            log.warning("events: cannot read the users file (%s); user accounts are refused until it is fixed", error)
            return None

    def login(self, username: str, token: str) -> bool:
        """Whether `token` is the API token of the user named `username`."""
        try:
            user = self.book.authenticate(token)
        except (OSError, UsersFileError) as error:
            log.warning("events: cannot read the users file (%s); user accounts are refused until it is fixed", error)
            return False
        return user is not None and user.name == username

    def readable(self, user: User) -> list[str]:
        """The topic filters a user may subscribe to and receive on."""
        from orchestrator.mqtt.topics import topic_level

        if user.admin:
            return [f"{self.prefix}/#"]
        return [f"{self.prefix}/users/{topic_level(user.name)}/#", f"{self.prefix}/service/status"]


class AccountsAuthPlugin(FileAuthPlugin):
    """amqtt's FileAuthPlugin (accounts and argon2 hashes from `password_file`), with the hash checked off
    the broker's event loop, connections without a username refused, and a last will refused on a topic
    that `publish_acl` does not let the account publish on (amqtt publishes and retains a will without
    asking the topic ACL: a reader could otherwise leave a retained `completed` state on disconnect)."""

    @dataclass
    class Config:
        password_file: str | Path | None = None
        publish_acl: dict[str, list[str]] = field(default_factory=dict)
        users_file: str | Path | None = None   # the service's users, each an account with their API token
        topic_prefix: str = "aspen/v1"

    async def authenticate(self, *, session: Session) -> bool:
        username = session.username if session else None
        if not username:
            log.info("events: refused an MQTT connection without credentials")
            return False
        stored = self._users.get(username)
        if stored is None and self.config.users_file is not None:
            accounts = UserAccounts(self.config.users_file, self.config.topic_prefix)
            if not await asyncio.to_thread(accounts.login, username, session.password or ""):
                log.info("events: refused an MQTT connection as '%s': no such user, or not their token", username)
                return False
            if session.will_flag:
                log.info("events: refused an MQTT connection as user '%s': users may not publish (its last will "
                         "is on '%s')", username, session.will_topic)
                return False
            return True
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
        users_file: str | Path | None = None
        topic_prefix: str = "aspen/v1"

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        users_file = self._get_config_option("users_file", None)
        self.accounts = UserAccounts(users_file, self._get_config_option("topic_prefix", "aspen/v1")) \
            if users_file else None

    async def topic_filtering(self, *, session: Session | None = None, topic: str | None = None,
                              action: Action | None = None) -> bool | None:
        """The generated accounts by the configured lists; a service user by the users file as it is now (for
        every message delivered too: a removed user's session gets nothing more)."""
        username = session.username if session else None
        static = username in self._get_config_option("publish_acl", {}) or \
            username in self._get_config_option("subscribe_acl", {})
        if static or self.accounts is None:
            if action == Action.RECEIVE:
                return True
            return await super().topic_filtering(session=session, topic=topic, action=action)
        user = await asyncio.to_thread(self.accounts.user, username)
        if user is None or not topic or action == Action.PUBLISH:
            return False
        return any(self.topic_ac(topic, allowed) for allowed in self.accounts.readable(user))


def embedded_broker_config(password_file: Path, credentials: BrokerCredentials, topic_prefix: str,
                           users_file: Path | None = None) -> dict[str, Any]:
    """The amqtt broker configuration: one listener whose socket `EmbeddedBroker` holds (amqtt's `external`
    type), only the generated accounts and the users of `users_file`, only the service publishing (under the
    prefix), the service and the reader subscribing to it, each user to their own jobs' topics."""
    topics = [f"{topic_prefix}/#"]
    publish_acl = {credentials.service.username: topics}
    subscribe_acl = {credentials.service.username: topics, credentials.reader.username: topics}
    users = {"users_file": str(users_file), "topic_prefix": topic_prefix} if users_file is not None else {}
    return {"listeners": {LISTENER: {"type": "external"}},
            "plugins": {f"{__name__}.AccountsAuthPlugin": {"password_file": str(password_file),
                                                           "publish_acl": publish_acl, **users},
                        f"{__name__}.TopicAclPlugin": {"publish_acl": publish_acl, "subscribe_acl": subscribe_acl,
                                                       **users}}}


class _Subscriptions(dict):
    """amqtt's subscription table (topic filter -> [(session, qos)]), walked over a copy. The broker awaits
    while it walks it (every delivery asks the topic ACL, which reads the users file in a thread; retained
    messages are sent to a returning session): a client subscribing or leaving meanwhile changed the table
    under the walk, which raised, and that message reached none of the subscribers still to come."""

    def __iter__(self) -> Iterator[str]:
        return iter(list(super().__iter__()))

    def items(self) -> list[tuple[str, list[tuple[Session, int]]]]:  # type: ignore[override]
        return [(topic, list(subscriptions)) for topic, subscriptions in super().items()]


class SubscriptionSafeBroker(Broker):
    """amqtt 0.12's Broker with its subscription table walked over a copy (`_Subscriptions`), and retained messages
    sent to a session only for the filters it holds itself."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self._subscriptions = _Subscriptions(self._subscriptions)

    async def _publish_retained_messages_for_subscription(self, subscription: tuple[str, int],
                                                          session: Session) -> None:
        """amqtt sends a connecting client the retained messages of every filter any client holds (meant for a
        returning session's own), without the topic ACL: a user connecting while the reader account held
        `aspen/v1/#` received every other user's retained job states. Only a filter this session holds now (a
        subscription it just made, or a returning session's) has its retained messages sent to it."""
        holders = self._subscriptions.get(subscription[0], ())
        if any(held is session or held.client_id == session.client_id for held, _ in holders):
            await super()._publish_retained_messages_for_subscription(subscription, session)


class EmbeddedBroker:
    """amqtt's broker behind a listening socket of our own on 127.0.0.1, handed each connection through
    amqtt's public `external_connected` (its way to embed the broker in a server of one's own): we bind, so
    we know the port (`embedded_port: 0` picks any free one) without reading the broker's internals."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.broker: Broker | None = None

    async def bind(self, port: int) -> None:
        """Take 127.0.0.1:`port` (0: any free port), accepting nobody yet; OSError where it is taken."""
        self.server = await asyncio.start_server(self._connected, "127.0.0.1", port, reuse_address=True,
                                                 start_serving=False)

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]

    async def start(self, config: dict[str, Any]) -> None:
        """Start the broker with `config` (`embedded_broker_config`), then accept connections."""
        assert self.server is not None
        self.broker = SubscriptionSafeBroker(config)
        await self.broker.start()
        try:
            await self.server.start_serving()
        except BaseException:
            await self.broker.shutdown()
            raise

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self.broker is not None   # connections are accepted only once it started
        await self.broker.external_connected(StreamReaderAdapter(reader), StreamWriterAdapter(writer), LISTENER)

    async def close(self) -> None:
        """Stop the broker (its sessions end), then the listening socket."""
        try:
            if self.broker is not None and self.broker.transitions.state == "started":
                await self.broker.shutdown()
        finally:
            if self.server is not None:
                self.server.close()
                await self.server.wait_closed()
