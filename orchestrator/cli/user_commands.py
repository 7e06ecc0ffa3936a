"""`aspen user add | set | list | token | remove` and `aspen http-token`: the users of a shared service
(actors/service/accounts/users.py), run on
the service's machine by whoever may write its state folder (the operator). A token is printed once, when it
is issued (`add`, `token --rotate`); `--json` prints `{"name", "token"}`. The service's single HTTP token
from before there were users (`aspen http-token`) becomes the first admin's; where the first user added is
not an admin, it stays valid as the admin `operator`'s (adding a user never locks the operator out)."""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from pathlib import Path

from actors.service.accounts.audit import AuditLog
from actors.service.accounts.users import OPERATOR, UserBook, UserError
from orchestrator import strict_json

DEFAULT_STATE_DIR = "~/.aspen"


def add_parser(commands: argparse._SubParsersAction) -> None:
    user = commands.add_parser("user", help="the users of a shared service and their API tokens (add, set, list, "
                                            "token, remove)")
    actions = user.add_subparsers(dest="action", required=True)

    def common(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--state-dir", default=DEFAULT_STATE_DIR,
                            help="the service's state folder, which holds users.json (default ~/.aspen)")
        parser.add_argument("--json", action="store_true", help="print the result as JSON")
        parser.set_defaults(handler=run)
        return parser

    add = common(actions.add_parser("add", help="add a user and print their token (shown once)"))
    add.add_argument("name", help="1-32 lower-case letters, digits, '-' or '_'")
    add.add_argument("--admin", action="store_true", help="may see and act on every user's jobs, and read the audit")
    add.add_argument("--share", type=float, default=1.0, help="their weight in the fair share (default 1)")
    add.add_argument("--quota", action="append", default=[], metavar="KEY=N",
                     help="running=N (jobs at once), queued=N (jobs waiting), tokens_per_day=N (trained over any 24 "
                          "hours); repeat for several")
    add.add_argument("--data-root", action="append", default=[], metavar="PATH|URI",
                     help="a folder or storage URI prefix their jobs may read, besides the service's data_roots "
                          "(repeat for several)")
    add.add_argument("--token-file", help="the service's single HTTP token (default ~/.aspen/http-token): the "
                                          "first admin takes it over")
    change = common(actions.add_parser("set", help="change a user's role, share, data roots or quotas (their token "
                                                   "stays); what is not given stays as it is"))
    change.add_argument("name")
    change.add_argument("--admin", action=argparse.BooleanOptionalAction, default=None,
                        help="--admin makes them an admin, --no-admin a user")
    change.add_argument("--share", type=float, default=None, help="their weight in the fair share")
    change.add_argument("--quota", action="append", default=[], metavar="KEY=N",
                        help="running=N, queued=N or tokens_per_day=N; KEY=none removes that limit; repeat for several")
    change.add_argument("--data-root", action="append", default=None, metavar="PATH|URI",
                        help="the folders or storage URI prefixes their jobs may read (the whole list: repeat for "
                             "several)")
    change.add_argument("--no-data-roots", action="store_true", help="remove all their data roots")
    common(actions.add_parser("list", help="every user (names, roles, shares; never tokens)"))
    token = common(actions.add_parser("token", help="issue a user a new token (--rotate): the old one stops at once"))
    token.add_argument("name")
    token.add_argument("--rotate", action="store_true", help="replace their token (required: tokens are kept only "
                                                             "as hashes, so an issued one cannot be shown again)")
    remove = common(actions.add_parser("remove", help="remove a user: their token is refused from the next request"))
    remove.add_argument("name")


def _legacy_token(path: str | None) -> str | None:
    from orchestrator.http.token import TokenFileError, read_token, token_file

    if not token_file(path).is_file():
        return None
    try:
        return read_token(path)
    except TokenFileError:
        return None


def _account() -> str:
    """Who ran the command: the machine's account (`os:<login>`), as the audit log names it."""
    try:
        return f"os:{getpass.getuser()}"
    except (KeyError, OSError):   # no login name (a container's anonymous uid)
        return f"os:uid-{os.getuid()}"


def _quotas(items: list[str], *, clearing: bool = False) -> dict[str, int | None]:
    """--quota KEY=N items; with `clearing`, KEY=none is None (the limit removed)."""
    quotas: dict[str, int | None] = {}
    for item in items:
        key, _, value = item.partition("=")
        if clearing and value.strip().lower() == "none":
            quotas[key.strip()] = None
            continue
        try:
            quotas[key.strip()] = int(float(value)) if value.strip() else -1
        except ValueError:
            hint = " or none" if clearing else ""
            raise UserError(f"--quota {item}: give KEY=N with N a whole number{hint} (e.g. running=4)") from None
    return quotas


def run(args: argparse.Namespace) -> int:
    book = UserBook.in_state_dir(Path(args.state_dir))
    audit = AuditLog.in_state_dir(Path(args.state_dir))
    if args.action == "add":
        had_users = book.exists() and bool(book.users())
        token, notes = book.add(args.name, admin=args.admin, share=args.share, data_roots=args.data_root,
                                quotas=_quotas(args.quota), adopt_token=_legacy_token(args.token_file))
        if token is None:   # the service's existing token became theirs
            token = _legacy_token(args.token_file)
        if not had_users and OPERATOR in {user.name for user in book.users()} and args.name != OPERATOR:
            audit.record(_account(), "user.add", OPERATOR, admin=True, share=1.0, data_roots=[],
                         reason="the service's single HTTP token, kept as an admin's when the first user was added")
        audit.record(_account(), "user.add", args.name, admin=args.admin, share=args.share,
                     data_roots=args.data_root)
        if not had_users:   # a service reads the users file of its own state folder: say which one this is
            notes.append(f"the users file is {book.path}: a service whose state folder is another (`aspen serve "
                         "--state-dir DIR`, its config's state_dir) reads its own; give `--state-dir DIR` to add "
                         "users there")
        _say(args, {"name": args.name, "token": token}, f"{token}", notes)
    elif args.action == "set":
        if args.data_root is not None and args.no_data_roots:
            raise UserError("give --data-root or --no-data-roots, not both")
        roots = [] if args.no_data_roots else args.data_root
        quotas = _quotas(args.quota, clearing=True)
        if args.admin is None and args.share is None and roots is None and not quotas:
            raise UserError(f"nothing to change for {args.name}: give --admin/--no-admin, --share, --data-root, "
                            "--no-data-roots or --quota")
        user = book.update(args.name, admin=args.admin, share=args.share, data_roots=roots, quotas=quotas)
        changed = {key: value for key, value in (("admin", args.admin), ("share", args.share),
                                                 ("data_roots", roots)) if value is not None}
        if quotas:
            changed["quotas"] = quotas
        audit.record(_account(), "user.set", args.name, **changed)
        public = user.public()
        public.pop("created_at")
        _say(args, public, f"{args.name}: " + ", ".join(f"{key} {value}" for key, value in public.items()
                                                          if key != "name"), [])
    elif args.action == "list":
        users = [user.public() for user in book.users()]
        if args.json:
            print(strict_json.dumps(users, indent=1))
        else:
            for user in users:
                quotas = " ".join(f"{key}={value}" for key, value in user["quotas"].items())
                print(f"{user['name']:<24}{'admin' if user['admin'] else 'user':<7}share {user['share']:g}"
                      + (f"  quotas {quotas}" if quotas else ""))
    elif args.action == "token":
        if not args.rotate:
            raise UserError(f"tokens are kept only as hashes, so {args.name}'s cannot be shown again: `aspen user "
                            f"token {args.name} --rotate` issues a new one (the old one stops working at once)")
        token = book.rotate(args.name)
        audit.record(_account(), "user.token", args.name)
        _say(args, {"name": args.name, "token": token}, token, [f"{args.name}'s old token is refused from now on"])
    else:
        book.remove(args.name)
        audit.record(_account(), "user.remove", args.name)
        _say(args, {"name": args.name, "removed": True}, f"removed {args.name}", [])
    return 0


def _say(args: argparse.Namespace, data: dict, text: str, notes: list[str]) -> None:
    import sys

    print(strict_json.dumps(data) if args.json else text)
    for note in notes:
        print(f"aspen: {note}", file=sys.stderr)


def cmd_http_token(args: argparse.Namespace) -> int:
    from actors.service.accounts.users import UserBook
    from orchestrator.http.token import ensure_token, token_file

    book = UserBook.in_state_dir(args.state_dir)
    if book.exists():   # the single token opens the API only where an admin holds it
        holder = book.authenticate(ensure_token(args.token_file)) if token_file(args.token_file).is_file() else None
        if holder is None or args.rotate:
            path = token_file(args.token_file)
            whose = "not one of them" if holder is None else (
                f"the admin '{holder.name}''s (`aspen user token {holder.name} --rotate` gives them a new one)")
            print(f"aspen: a users file is in force ({book.path}): the API takes only its users' tokens, and "
                  f"{path} is {whose}. `aspen user add NAME --admin` issues an admin a token; `aspen user token "
                  "NAME --rotate` a user a new one", file=sys.stderr)
            return 1
        print(ensure_token(args.token_file))
        print(f"aspen: this token is the admin '{holder.name}''s (a users file is in force: {book.path})",
              file=sys.stderr)
        return 0
    token = ensure_token(args.token_file, rotate=args.rotate)
    print(token)
    if args.rotate:
        print(f"aspen: a new token is in {token_file(args.token_file)}; restart `aspen http` to use it",
              file=sys.stderr)
    return 0
