"""The users of a shared service: their names, roles, shares, and API tokens kept only as SHA-256 hashes.

One JSON file, `<state_dir>/users.json` (mode 0600 in a folder of mode 0700), changed by `aspen user ...`
under a lock (`users.json.lock`: two commands at once do not lose each other's change) and written
atomically; the HTTP API reads it again whenever it changed (its size, time or inode), so a removed user or
a rotated token is refused from the next request on. A token is shown once, when it is issued; the file
holds its hash only (a 256-bit random token needs no slow hash: it cannot be guessed from a list). The
service's single token from before there were users (`aspen http-token`) becomes the first admin's.
Ray-free and torch-free."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from actors.spec.field_types import USER_NAME_PATTERN
from actors.storage.durable import write_durably

USERS_FILE = "users.json"
TOKEN_BYTES = 32          # 256 bits, 43 URL-safe characters (as the service's own token)
FORMAT = 1


class UserError(ValueError):
    """A user command that cannot be carried out (unknown or duplicate name, bad value); nothing changed."""


class UsersFileError(OSError):
    """The users file cannot be read (damaged, or readable by others); the message says what to do."""


@dataclass(frozen=True)
class User:
    name: str
    admin: bool
    share: float               # the weight of the user's fair share of the trainers
    token_sha256: str
    created_at: float
    data_roots: tuple[str, ...] = ()   # where their jobs may read besides the service's data roots
    max_running: int | None = None     # quotas (None: no limit): jobs running at once,
    max_queued: int | None = None      # jobs queued,
    tokens_per_day: int | None = None  # tokens trained over any 24 hours

    def public(self) -> dict:
        """What `aspen user list` shows: everything but the token's hash."""
        return {"name": self.name, "admin": self.admin, "share": self.share, "data_roots": list(self.data_roots),
                "quotas": self.quotas(), "created_at": self.created_at}

    def quotas(self) -> dict[str, int]:
        return {key: value for key, value in (("running", self.max_running), ("queued", self.max_queued),
                                              ("tokens_per_day", self.tokens_per_day)) if value is not None}


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def check_name(name: str) -> str:
    if not re.match(USER_NAME_PATTERN, name or ""):
        raise UserError(f"user name {name!r}: use 1-32 lower-case letters, digits, '-' or '_', starting with a letter")
    return name


QUOTAS = ("running", "queued", "tokens_per_day")


def check_quotas(quotas: dict[str, int]) -> dict[str, int]:
    unknown = sorted(set(quotas) - set(QUOTAS))
    if unknown:
        raise UserError(f"quota {', '.join(unknown)}: the quotas are {', '.join(QUOTAS)} (e.g. --quota running=4)")
    for key, value in quotas.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value > 2**62:
            raise UserError(f"quota {key}={value!r}: give a whole number >= 0")
    return dict(quotas)


OPERATOR = "operator"
"""The admin holding the service's single HTTP token when the first user added is not an admin (`UserBook.add`)."""


class UserBook:
    """The users file at `path` (`<state_dir>/users.json`)."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self._seen: tuple[int, int, int] | None = None
        self._users: dict[str, User] = {}

    @classmethod
    def in_state_dir(cls, state_dir: str | Path) -> UserBook:
        return cls(Path(state_dir).expanduser() / USERS_FILE)

    def exists(self) -> bool:
        return self.path.is_file()

    # -- reading ----------------------------------------------------------------------------------
    def users(self) -> list[User]:
        """Every user, by name (read again when the file changed)."""
        self._refresh()
        return sorted(self._users.values(), key=lambda user: user.name)

    def get(self, name: str) -> User:
        self._refresh()
        if name not in self._users:
            raise UserError(f"no user named '{name}' in {self.path} (`aspen user list` shows them)")
        return self._users[name]

    def authenticate(self, token: str) -> User | None:
        """The user whose token this is, or None."""
        self._refresh()
        digest = token_hash(token)
        found = None
        for user in self._users.values():   # every hash compared, in constant time each
            if hmac.compare_digest(user.token_sha256, digest):
                found = user
        return found

    def stamp(self) -> tuple[int, int, int] | None:
        """The file's time, size and inode as they are now (None: no file): a change of it is a change of the
        users (every change replaces the file). One stat, cheap enough to ask before each decision."""
        try:
            info = self.path.stat()
        except FileNotFoundError:
            return None
        return info.st_mtime_ns, info.st_size, info.st_ino

    def _refresh(self) -> None:
        seen = self.stamp()
        if seen is None:
            self._seen, self._users = None, {}
            return
        if seen != self._seen:
            self._users = self._read()
            self._seen = seen

    def _read(self) -> dict[str, User]:
        mode = self.path.stat().st_mode
        if mode & 0o077:
            raise UsersFileError(f"{self.path} is readable by other accounts (mode {oct(mode & 0o777)}); its hashes "
                                 f"name every user: `chmod 600 {self.path}`")
        try:
            data = json.loads(self.path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, not {FORMAT}")
            return {entry["name"]: User(**{**entry, "data_roots": tuple(entry.get("data_roots", ()))})
                    for entry in data["users"]}
        except (ValueError, KeyError, TypeError) as error:
            raise UsersFileError(f"{self.path} cannot be read ({type(error).__name__}: {error}); restore it from a "
                                 "backup, or delete it and add the users again (their tokens change)") from None

    # -- changing ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _changing(self) -> Iterator[dict[str, User]]:
        """The users under the file's lock; what the block leaves in the dict is written atomically."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        with os.fdopen(descriptor, "r+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self._seen = None
                self._refresh()
                users = dict(self._users)
                yield users
                body = {"format": FORMAT, "users": [asdict(users[name]) for name in sorted(users)]}
                write_durably(self.path, json.dumps(body, indent=1) + "\n", private=True)
                self._seen = None
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def add(self, name: str, *, admin: bool = False, share: float = 1.0, data_roots: Sequence[str] = (),
            quotas: dict[str, int] | None = None, adopt_token: str | None = None) -> tuple[str | None, list[str]]:
        """Add a user; returns their new token (None where `adopt_token` became theirs) and notes. The first
        admin takes `adopt_token` (the service's token from before there were users) where it is given; where
        the first user added is not an admin, that token stays valid as the admin OPERATOR's, so that adding a
        user never locks the operator out."""
        check_name(name)
        if not (0 < share <= 1000):
            raise UserError(f"share {share}: give a weight above 0 and at most 1000 (1: an equal share)")
        limits = check_quotas(quotas or {})
        notes = []
        with self._changing() as users:
            if name in users:
                raise UserError(f"user '{name}' exists; `aspen user set {name} ...` changes their role, share, data "
                                f"roots or quotas (their token stays); `aspen user token {name} --rotate` issues a "
                                "new token")
            token: str | None = secrets.token_urlsafe(TOKEN_BYTES)
            digest = token_hash(token)
            if admin and adopt_token and not any(user.admin for user in users.values()):
                token, digest = None, token_hash(adopt_token)
                notes.append(f"the service's existing HTTP token (`aspen http-token`) is now {name}'s")
            elif adopt_token and not users and name != OPERATOR:
                # the first user, not an admin: the token the operator has used so far would stop opening the API
                # (a users file, once there, is the only way in); it stays theirs, as an admin of its own
                users[OPERATOR] = User(OPERATOR, True, 1.0, token_hash(adopt_token), round(time.time(), 3), ())
                notes.append(f"a users file is in force from now on: only users' tokens open the API. The service's "
                             f"existing HTTP token (`aspen http-token`) stays valid as the admin '{OPERATOR}'; "
                             f"`aspen user remove {OPERATOR}` retires it once you have another admin "
                             "(`aspen user add NAME --admin`)")
            if any(hmac.compare_digest(user.token_sha256, digest) for user in users.values()):
                raise UserError("that token is another user's already")
            users[name] = User(name, admin, float(share), digest, round(time.time(), 3), tuple(map(str, data_roots)),
                               max_running=limits.get("running"), max_queued=limits.get("queued"),
                               tokens_per_day=limits.get("tokens_per_day"))
        return token, notes

    def update(self, name: str, *, admin: bool | None = None, share: float | None = None,
               data_roots: Sequence[str] | None = None, quotas: dict[str, int | None] | None = None) -> User:
        """Change a user's role, share, data roots (the whole list) or quotas (each given one; None clears it),
        keeping their token. Returns the user as changed."""
        if share is not None and not (0 < share <= 1000):
            raise UserError(f"share {share}: give a weight above 0 and at most 1000 (1: an equal share)")
        quotas = quotas or {}
        check_quotas({key: value for key, value in quotas.items() if value is not None})
        fields = {"running": "max_running", "queued": "max_queued", "tokens_per_day": "tokens_per_day"}
        with self._changing() as users:
            if name not in users:
                raise UserError(f"no user named '{name}' in {self.path} (`aspen user list` shows them; `aspen user "
                                f"add {name}` adds them)")
            user = users[name]
            if admin is False and user.admin and sum(u.admin for u in users.values()) == 1:
                raise UserError(f"'{name}' is the last admin; add another admin first (`aspen user add NAME --admin`)")
            changes: dict = {fields[key]: value for key, value in quotas.items()}
            if admin is not None:
                changes["admin"] = admin
            if share is not None:
                changes["share"] = float(share)
            if data_roots is not None:
                changes["data_roots"] = tuple(map(str, data_roots))
            users[name] = user = replace(user, **changes)
        return user

    def rotate(self, name: str) -> str:
        """A new token for `name`; the old one is refused from now on."""
        token = secrets.token_urlsafe(TOKEN_BYTES)
        with self._changing() as users:
            if name not in users:
                raise UserError(f"no user named '{name}' in {self.path} (`aspen user list` shows them)")
            user = users[name]
            users[name] = replace(user, token_sha256=token_hash(token))
        return token

    def remove(self, name: str) -> None:
        with self._changing() as users:
            if name not in users:
                raise UserError(f"no user named '{name}' in {self.path} (`aspen user list` shows them)")
            if users[name].admin and sum(user.admin for user in users.values()) == 1 and len(users) > 1:
                raise UserError(f"'{name}' is the last admin; add another admin first (`aspen user add NAME "
                                "--admin`)")
            del users[name]   # the last one too: the file stays, and no token opens the API until one is added
