"""`thermowatch` command line.

Each subcommand imports what it needs inside its handler, so `thermowatch --help` is instant
and `replay` never starts Ray. The manual commands, the read commands (status, incidents,
export: supervisor.operate.report), `flush` and `login` talk to the daemon over HTTP (supervisor.operate.client); only
`serve`, `train`, `demo`, `db` and `token` open a database; `validate-config` and `simulate` touch
neither. Exit codes: 0 ok, 1 the job ran
and failed, 2 bad usage or bad input, or a request the daemon refused (the message says which
value and how to fix it), 3 no daemon answered at the address (the message names it and how
to point elsewhere).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from thermowatch.supervisor.errors import DaemonUnreachable, UserError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


def _supervisor_config(args: argparse.Namespace):
    from thermowatch.supervisor.app.config import SupervisorConfig

    return SupervisorConfig.load(
        getattr(args, "config", None),
        db_url=getattr(args, "db", None),
        data_dir=getattr(args, "data_dir", None),
        host=getattr(args, "host", None),
        port=getattr(args, "port", None),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from thermowatch.supervisor.serve.server import serve

    return serve(_supervisor_config(args), auto_upgrade=not args.no_upgrade)


def cmd_train(args: argparse.Namespace) -> int:
    from thermowatch.launch import train

    return train(args.config_file, supervisor_url=args.supervisor, sup_config=_supervisor_config(args),
                 verbose=args.verbose, progress_every=args.progress_every, detach=args.detach,
                 restarts=args.restarts)


def cmd_demo(args: argparse.Namespace) -> int:
    from thermowatch.demo import DemoOptions, run_demo

    opts = DemoOptions(
        data_dir=Path(args.data_dir),
        json_summary=Path(args.json_summary) if args.json_summary else None,
        compare=args.compare,
        steps=args.steps,
        dtype=args.dtype,
        progress=not args.no_progress,
        db_url=args.db or "",
        config=Path(args.config) if args.config else None,
    )
    return run_demo(opts)


def cmd_replay(args: argparse.Namespace) -> int:
    from thermowatch.monitors.detectors import BankConfig
    from thermowatch.monitors.replay import replay
    from thermowatch.supervisor.decide.replay_policy import replay_decider

    from thermowatch.monitors.config_tree import ConfigTreeError, check_tree
    from thermowatch.supervisor.app.config import ConfigError
    from thermowatch.supervisor.decide.policy import PolicyConfig
    from thermowatch.supervisor.decide.replay_policy import REPLAY_KEYS

    policy, detectors = _load_mapping(args.policy), _load_mapping(args.detectors)
    policy_fields = {k: v for k, v in policy.items() if k not in REPLAY_KEYS}  # replay's own keys aside
    for path, cls, values in ((args.policy, PolicyConfig, policy_fields), (args.detectors, BankConfig, detectors)):
        try:
            check_tree(cls, values)
        except ConfigTreeError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    decide = None if args.no_policy else replay_decider(policy)
    detector_cfg = BankConfig.from_dict(detectors)
    return replay(args.file, detector_cfg, sys.stdout, json_out=args.json, policy=decide)


def cmd_simulate(args: argparse.Namespace) -> int:
    from thermowatch.supervisor.simulate.compare import simulate
    from thermowatch.supervisor.simulate.config import SimConfig
    from thermowatch.supervisor.simulate.report import print_table, to_json

    rep = simulate(SimConfig.load(args.config), seed=args.seed)
    if args.json:
        print(to_json(rep))
    else:
        print_table(rep, sys.stdout)
    return EXIT_OK


def cmd_validate_config(args: argparse.Namespace) -> int:
    from thermowatch.launch import validate_config

    for line in validate_config(args.file, kind=args.kind):
        print(line)
    return EXIT_OK


def cmd_db(args: argparse.Namespace) -> int:
    from thermowatch.supervisor import db

    cfg = _supervisor_config(args)
    if args.db_command == "upgrade":
        db.upgrade(cfg.db_url)
        print(f"database at {db.redact(cfg.db_url)} is at the newest revision")
        return EXIT_OK
    engine = db.make_engine(cfg.db_url)
    try:
        db.check_current(engine)
    except db.SchemaOutOfDate as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_FAILED
    if args.db_command == "rollups":
        return _backfill_rollups(engine)
    print("database is current")
    return EXIT_OK


def _backfill_rollups(engine) -> int:
    """Roll up every run's stored history (one transaction per run; safe to repeat, and while
    the daemon runs: rows are upserts of the same content)."""
    from thermowatch.supervisor import db
    from thermowatch.supervisor.store import rollups
    from thermowatch.supervisor.store import runs as runs_store

    sessions = db.make_sessionmaker(engine)
    done = 0
    for page in runs_store.each_page(sessions):
        for run in page:
            with sessions.begin() as s:
                n = rollups.backfill(s, run.run_id)
            print(f"{run.run_id}: {n} rollup rows written")
            done += 1
    print(f"rolled up {done} run(s)")
    return EXIT_OK


def cmd_token(args: argparse.Namespace) -> int:
    """Token administration, straight on the database like `db`: it is how the first scoped
    tokens are made and how an operator recovers after losing every admin token, so it must work
    with the daemon down or locked; whoever holds the database URL is an admin anyway. Remote
    admins use POST /api/tokens with an admin token."""
    from thermowatch.supervisor import db
    from thermowatch.supervisor.serve.api import tokens as tokens_api

    cfg = _supervisor_config(args)
    engine = db.make_engine(cfg.db_url)
    try:
        db.check_current(engine)
        sessions = db.make_sessionmaker(engine)
        if args.token_command == "create":
            row, secret = tokens_api.create(sessions, args.name, args.scope or [], "cli", args.run_prefix)
            bound = f", opening only runs named {row.run_prefix}..." if row.run_prefix else ""
            print(f"created token {row.name!r} with scopes {', '.join(row.scopes)}{bound}; its secret, shown only now "
                  f"(only its SHA-256 digest is stored):", file=sys.stderr)
            print(secret)
        elif args.token_command == "revoke":
            tokens_api.revoke(sessions, args.name, "cli")
            print(f"revoked token {args.name!r}; requests carrying it are refused from now on")
        else:
            rows = tokens_api.listing(sessions)
            for t in rows:
                state = f"revoked {t['revoked_at'][:19]}Z" if t["revoked_at"] else "active"
                prefix = f"  runs {t['run_prefix']}*" if t["run_prefix"] else ""
                print(f"{t['name']:<30} {','.join(t['scopes']):<28} created {t['created_at'][:19]}Z  {state}{prefix}")
            if not rows:
                print("(no tokens)")
    except db.SchemaOutOfDate as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_FAILED
    finally:
        engine.dispose()
    return EXIT_OK


def cmd_manual(args: argparse.Namespace) -> int:
    """rollback / skip / lr / pause / resume / stop / approve / actions / runs: through the
    daemon's API, which writes the same action rows the automatic policy writes, so one
    executor and one audit trail serve both."""
    from thermowatch.supervisor.operate.manual import run_manual

    return run_manual(args)


def cmd_plot(args: argparse.Namespace) -> int:
    """A chart of one metric (a key or a family prefix) as a PNG file, through the daemon's
    GET /api/runs/{run}/chart.png (read from the rollups: fast at any history length)."""
    from thermowatch.supervisor.operate.client import Client, resolve, run_path
    from thermowatch.supervisor.operate.files import target_of, write_file

    out = Path(args.output)
    target_of(out, "-o")  # a device, a directory or a missing folder: refused before asking the daemon
    with Client(resolve(args.server, args.token), timeout=120.0) as api:
        png = api.get_bytes(f"{run_path(args.run_id)}/chart.png", metric=args.metric, step_lo=args.step_lo,
                            step_hi=args.step_hi, attempts=args.attempts, onset=args.onset, incident=args.incident,
                            width=args.width, height=args.height)
    write_file(out, png, flag="-o")
    print(f"wrote {out} ({len(png)} bytes): {args.run_id} {args.metric}")
    return EXIT_OK


def cmd_login(args: argparse.Namespace) -> int:
    """Check an address and token against the daemon, then remember them for this user."""
    import getpass

    from thermowatch.supervisor.operate.client import TOKEN_ENV, Client, resolve, save_login

    token = args.token
    if token is None and not args.no_token:
        if not sys.stdin.isatty():  # a script, a pipe, CI: nobody to type it (issue 23: a traceback)
            raise UserError("login needs a token and there is no terminal to type it in: pass --token TOKEN "
                            f"(or --no-token for a daemon with auth off), or set {TOKEN_ENV}")
        token = getpass.getpass("token (input hidden; empty for none): ").strip() or None
    ep = resolve(args.server, token)
    with Client(ep) as api:
        page = api.get("/api/runs", limit=100)  # proves the address and that the token may read
    n = f"{len(page['runs'])}{'+' if page.get('next_cursor') else ''}"
    path = save_login(ep.server, ep.token)
    print(f"logged in to {ep.server} ({n} run(s) visible); saved to {path} (readable by you only)")
    return EXIT_OK


def cmd_flush(args: argparse.Namespace) -> int:
    """Send what a trainer left in its spool to the daemon now (thermowatch.flush)."""
    from thermowatch.flush import flush

    return flush(args.dir, args.server, args.token, timeout_s=args.timeout)


def _load_mapping(path: str | None) -> dict:
    from thermowatch.supervisor.app.config import read_mapping

    return read_mapping(Path(path)) if path else {}


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    from thermowatch.supervisor.operate.client import SERVER_ENV, TOKEN_ENV

    p.add_argument("--server", help=f"the daemon's URL, or its replicas' comma-separated, tried in turn (default: "
                                    f"${SERVER_ENV}, then `thermowatch login`'s, then http://127.0.0.1:8765)")
    p.add_argument("--token", help=f"API token (default: ${TOKEN_ENV}, then `thermowatch login`'s)")


def _add_db_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="supervisor YAML config (lists only what differs from defaults)")
    p.add_argument("--db", help="database URL (default: SQLite in the data dir)")
    p.add_argument("--data-dir", help="data directory (default: .thermowatch)")


def build_parser() -> argparse.ArgumentParser:
    from thermowatch.monitors.commands import INT64_MAX
    from thermowatch.monitors.settings import arg_int  # every numeric flag: finite, in range, or exit 2
    from thermowatch.supervisor import version

    parser = argparse.ArgumentParser(prog="thermowatch", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"thermowatch {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the supervisor daemon (ingest, detectors, policy, API, web, jobs)")
    _add_db_flags(p)
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=arg_int(1, 65535), help="port (default 8765)")
    p.add_argument("--no-upgrade", action="store_true", help="refuse to start on an old schema instead of migrating")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("train", help="launch a supervised training run")
    p.add_argument("config_file", help="training config (YAML/JSON; only what differs from defaults)")
    p.add_argument("--supervisor", help="URL of a running daemon, or its replicas' comma-separated (the sink fails "
                                        "over between them); default: an embedded one in this process")
    p.add_argument("--progress-every", type=arg_int(1), default=10, metavar="N",
                   help="a progress line (step, loss, tokens/s, max attention logit, ETA) every N steps")
    p.add_argument("-v", "--verbose", action="store_true", help="also log every HTTP request (httpx, httpcore)")
    p.add_argument("--detach", action="store_true",
                   help="run the controller as a detached Ray actor on the cluster at RAY_ADDRESS (needs "
                        "--supervisor): it survives this command, and Ray restarts it when its process dies; "
                        "the same command again attaches to it")
    p.add_argument("--restarts", type=arg_int(0), default=10, metavar="N",
                   help="with --detach: how often Ray may restart a dead controller (default 10)")
    _add_db_flags(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("demo", help="a diverging 2-rank ZeRO run on CPU, caught and repaired by the supervisor")
    p.add_argument("--data-dir", default=".thermowatch-demo")
    p.add_argument("--json-summary", help="write incidents, actions, skipped ranges and final loss here")
    p.add_argument("--compare", action="store_true", help="also train the same run without the supervisor")
    p.add_argument("--steps", type=arg_int(1), default=None, help="shorten the run (CI)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the weights' dtype (default bfloat16, as the trainer runs at scale); float32 trains "
                        "~5x faster on a CPU without AVX-512, where bf16 matmuls are emulated (CI)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--db", help="database URL (default: SQLite in the data dir)")
    p.add_argument("--config", metavar="SUPERVISOR.yaml",
                   help="a supervisor config: its slack/pagerduty/webhook channels and policy/detector settings "
                        "are used (its database and data dir are not), so the demo's story arrives where your "
                        "runs' will")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("replay", help="feed a recorded run (JSONL/CSV) through the detectors and the policy",
                       epilog="exit status: 0 no finding, 1 findings present (a script can test it), "
                              "2 a bad file or setting")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="one JSON object per finding")
    p.add_argument("--detectors", help="detector settings that differ from defaults (YAML/JSON)")
    p.add_argument("--policy", help="policy settings that differ from defaults (YAML/JSON)")
    p.add_argument("--no-policy", action="store_true", help="findings only")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("simulate", help="goodput of a long run at scale under public failure rates, by strategy")
    p.add_argument("--config", help="simulation settings that differ from the defaults (YAML)")
    p.add_argument("--seed", type=arg_int(0, 2**63 - 1), default=0, help="the same seed gives the same table")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("validate-config", help="check a supervisor or training config file; starts nothing")
    p.add_argument("file")
    p.add_argument("--kind", choices=["auto", "supervisor", "train"], default="auto",
                   help="which config the file is (default: told by its keys)")
    p.set_defaults(func=cmd_validate_config)

    p = sub.add_parser("db", help="database schema")
    p.add_argument("db_command", choices=["upgrade", "current", "rollups"],
                   help="rollups: backfill the chart rollups of histories stored before migration 0010")
    _add_db_flags(p)
    p.set_defaults(func=cmd_db)

    p = sub.add_parser("token", help="API tokens: create (the secret is printed once), list, revoke")
    tsub = p.add_subparsers(dest="token_command", required=True)
    tp = tsub.add_parser("create", help="a new token; prints its secret on stdout, once")
    tp.add_argument("name", help="who or what holds it (the actor name in the audit trail): trainer-run42, alice")
    tp.add_argument("--scope", action="append", choices=["ingest", "read", "operate", "admin"], required=True,
                    help="repeat for several; operate implies read, admin implies all")
    tp.add_argument("--run-prefix", default="", metavar="PREFIX",
                    help="an ingest token opens only runs whose id starts with PREFIX (it writes only the runs it "
                         "opened either way; docs/auth.md)")
    _add_db_flags(tp)
    tp = tsub.add_parser("list", help="names, scopes, created and revoked times (never secrets)")
    _add_db_flags(tp)
    tp = tsub.add_parser("revoke", help="refuse the token from now on (the row stays, for the audit trail)")
    tp.add_argument("name")
    _add_db_flags(tp)
    p.set_defaults(func=cmd_token)

    from thermowatch.supervisor.operate.manual import add_manual_commands

    add_manual_commands(sub, _add_client_flags, cmd_manual)

    from thermowatch.supervisor.operate.report import add_read_commands

    add_read_commands(sub, _add_client_flags)

    p = sub.add_parser("plot", help="save a chart of a run's metric as a PNG (through the daemon)")
    p.add_argument("run_id")
    p.add_argument("metric", help="a full key (loss, attn_logit_max/blocks.3.attn) or a family (attn_logit_max)")
    p.add_argument("-o", "--output", required=True, help="the PNG file to write")
    p.add_argument("--step-lo", type=arg_int(0, INT64_MAX), help="first step of the window (default: the run's first)")
    p.add_argument("--step-hi", type=arg_int(0, INT64_MAX), help="last step of the window, inclusive (default: the run's last)")
    p.add_argument("--attempts", choices=["all", "current"], default="all",
                   help="all: abandoned trajectories faded beneath the live path; current: the live path only")
    p.add_argument("--onset", type=arg_int(0, INT64_MAX), help="draw a finding's onset at this step")
    p.add_argument("--incident", type=arg_int(0, INT64_MAX), help="draw this incident heavier")
    p.add_argument("--width", type=arg_int(200, 4000), default=1100, help="pixels (200..4000)")
    p.add_argument("--height", type=arg_int(120, 2000), default=320, help="pixels (120..2000)")
    _add_client_flags(p)
    p.set_defaults(func=cmd_plot)

    from thermowatch.monitors.settings import arg_float

    p = sub.add_parser("flush", help="send what a trainer left in its spool directory to the daemon now",
                       epilog="exit status: 0 everything was sent (or nothing waited), 1 the daemon failed (5xx) "
                              "and it is still spooled, 2 the token or a message was refused, 3 no daemon answered")
    p.add_argument("dir", help="the spool directory the trainer's close line named, or a run's state directory "
                               "(thermowatch.watch's checkpoint_dir) that holds spool/")
    p.add_argument("--timeout", type=arg_float(0, lo_open=True), default=120.0, metavar="SECONDS",
                   help="give up after this long; what is not sent stays spooled (default 120)")
    _add_client_flags(p)
    p.set_defaults(func=cmd_flush)

    p = sub.add_parser("login", help="check a daemon's address and token and remember them for the CLI")
    _add_client_flags(p)
    p.add_argument("--no-token", action="store_true", help="a daemon that needs none (loopback development)")
    p.set_defaults(func=cmd_login)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except UserError as exc:  # a person's mistake: its message names the value and the fix
        print(f"thermowatch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except DaemonUnreachable as exc:
        print(f"thermowatch: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except BrokenPipeError:  # `thermowatch actions RUN | head`: the reader has all it wanted
        try:  # as Python's docs advise: the interpreter's final flush must not raise it again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
