"""Scrub secrets out of child command lines before they are recorded on spans.

With `STALLWATCH_RECORD_ARGS=true` a child's argv (or a shell's command string) becomes the span
attribute `process.command_args`. Command lines routinely carry credentials: `--password=...`,
`PGPASSWORD=... psql`, `curl -H "Authorization: Bearer ..."`, `git clone https://user:token@...`,
`ssh -i /home/ops/.ssh/id_prod`. This module replaces them with `[REDACTED]` (identity files with a
short fingerprint of their file name) and bounds what is recorded.

It is hand-written because no maintained library scrubs argv for secrets: log-scrubbing and
secret-scanning tools work on free text or files, know nothing of option/value pairs split across
arguments, and are far too heavy to import into every instrumented process. It uses only the
standard library and never raises: a scrubber failure must not take down the host's spawn.

Layers, each meant to catch what another misses (the policy is to leak nothing, at the price of
sometimes hiding a harmless value):

1. Shapes anywhere in an argument: URL user-info, `user:pass@host`, `Bearer`/`Basic` credentials,
   SQL `PASSWORD '...'` literals, JWTs, AWS access key ids, GitHub/GitLab/Slack/... tokens, PEM
   private keys, long high-entropy hex/base64 runs, and `name=value` / `name: value` pairs whose
   name is secret.
2. Structure, word by word (shell quoting understood, so a shell command string is scrubbed like an
   argv): `--name=value`, `--name value`, `KEY=VALUE`, `Header: value`, ssh identity files, and
   per-program short options (`sshpass -p`, `docker login -p`, `curl -u`, `mysql -p...`, ...).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

MAX_ARGS = 64  # arguments recorded; beyond, the last recorded element says how many were left out
MAX_ARG_CHARS = 512  # characters recorded per argument, truncation marker included
MAX_NAME_CHARS = 128  # characters of an executable name
REDACTED = "[REDACTED]"
TRUNCATED = "...[truncated]"
UNSCRUBBABLE = "[arguments could not be scrubbed]"  # the whole result if scrubbing itself failed

_SCAN_CHARS = 2 * MAX_ARG_CHARS  # an argument is cut to this many characters (at a word boundary) first
_MAX_DEPTH = 8  # nesting of quoted words / KEY=VALUE values; deeper text is redacted whole

# Actions for the value of a secret-named option or key.
_SECRET = "secret"  # replace the value with [REDACTED]
_IDENTITY = "identity"  # replace the path with key:<fingerprint of its file name>
_USER = "user"  # `user:password`: redact what follows the first colon
_MAYBE_IDENTITY = "maybe-identity"  # `-i` outside ssh: an identity file if it looks like a path

# Option / key names whose value is secret: searched (lower-cased, dashes kept) in the name.
_SECRET_NAME = re.compile(
    r"passw|pwd|passphrase|pass(?![a-z])|pass(?:in|out|code|key)|token|secret|key|credential"
    r"|auth(?!ors?(?![a-z])|ority|orities)|cookie|session|signature|(?<![a-z])sig(?![a-z])|bearer|jwt|dsn"
    r"|(?<![a-z])(?:pat|otp)(?![a-z])"
)
# Names (lower-cased, without `-_.`) that contain a secret word but never carry a secret value:
# ssh options taking yes/no or algorithm lists, and flags that take no value at all.
_NOT_SECRET = frozenset(
    {
        "addkeystoagent",
        "casignaturealgorithms",
        "challengeresponseauthentication",
        "gssapiauthentication",
        "gssapikeyexchange",
        "hostbasedauthentication",
        "hostkeyalgorithms",
        "hostkeyalias",
        "kbdinteractiveauthentication",
        "numberofpasswordprompts",
        "passwordauthentication",
        "preferredauthentications",
        "pubkeyacceptedalgorithms",
        "pubkeyacceptedkeytypes",
        "pubkeyauthentication",
        "revokedhostkeys",
        "stricthostkeychecking",
        "updatehostkeys",
        "verifyhostkeydns",
    }
)
_VALUELESS = frozenset({"anyauth", "authnochallenge", "keepsessioncookies", "sortkeys"})
_IDENTITY_NAME = re.compile(r"o?identity(?:file)?")  # normalised; `o` for `-oIdentityFile=`
_USER_OPTIONS = frozenset({"user", "proxyuser", "cert", "proxycert"})  # `--user name:password`
_SETTERS = frozenset({"set", "config", "--global", "--local", "--system", "--worktree", "--add", "--replace-all"})

# Known programs (basename, lower-cased) -> the context their short options are read in.
_PROGRAMS = {
    name: context
    for context, names in (
        ("ssh", ("ssh", "scp", "sftp", "autossh", "sshfs", "ssh-copy-id")),
        ("shell", ("sh", "bash", "dash", "zsh", "ksh", "ash", "fish")),
        ("mysql", ("mysql", "mysqldump", "mysqladmin", "mysqlimport", "mysqlcheck", "mysqlshow", "mariadb")),
        ("ldap", ("ldapsearch", "ldapadd", "ldapmodify", "ldapdelete", "ldapwhoami", "ldappasswd")),
        ("zip", ("zip", "unzip")),
        ("7z", ("7z", "7za", "7zr")),
        ("useradd", ("useradd", "usermod")),
        ("sshpass", ("sshpass",)),
        ("curl", ("curl",)),
        ("openssl", ("openssl",)),
        ("redis-cli", ("redis-cli",)),
        ("sqlcmd", ("sqlcmd",)),
        ("htpasswd", ("htpasswd",)),
        ("login", ("login",)),  # docker/podman/helm/az/oc ... login
    )
    for name in names
}
# Per context, the single-letter options whose value is secret: letter -> (action, value may be separate).
# A value glued to the letter (`-pS3cret`) is always scrubbed; mysql's lone `-p` prompts, so its next word stays.
_SHORT_OPTIONS: dict[str, dict[str, tuple[str, bool]]] = {
    "sshpass": {"p": (_SECRET, True)},
    "login": {"p": (_SECRET, True)},  # docker/podman/helm/az/oc ... login -p
    "curl": {"u": (_USER, True), "U": (_USER, True), "E": (_USER, True), "b": (_SECRET, True)},
    "mysql": {"p": (_SECRET, False)},
    "openssl": {"k": (_SECRET, True)},
    "redis-cli": {"a": (_SECRET, True)},
    "sqlcmd": {"P": (_SECRET, True)},
    "ldap": {"w": (_SECRET, True)},
    "zip": {"P": (_SECRET, True)},
    "7z": {"p": (_SECRET, False)},
    "useradd": {"p": (_SECRET, True)},
}
_SSH_FLAGS_WITH_VALUE = "BbcDEeFIiJLlmOoPpQRSWw"

# ---- layer 1: shapes anywhere in an argument ----------------------------------------------------

_SCHEME = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://")
_BARE_USERINFO = re.compile(r"(?<![\w.%+\-/:@\[])[\w.%+\-~]+:[^\s@/]+@(?!sha\d+:)(?=[\w\[])")
_PEM = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.S)
_AUTH_SCHEME = re.compile(r"(?i)(?<![A-Za-z0-9])(bearer|basic)(\s+)[^\s'\"]+")
_SQL_PASSWORD = re.compile(r"(?i)(?<![\w-])(password|identified\s+by)(\s+)'(?:[^']|'')*'?")  # ... PASSWORD 'x'
_TOKENS = re.compile(
    r"eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}(?:\.[A-Za-z0-9_-]*)*"  # JWT (JWS, JWE)
    r"|(?<![A-Za-z0-9])(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}(?![A-Za-z0-9])"  # AWS access key id
    r"|(?<![A-Za-z0-9])(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})"  # GitHub
    r"|(?<![A-Za-z0-9])(?:glpat-[A-Za-z0-9_-]{20,}|xox[abposr]-[A-Za-z0-9-]{10,}|[sr]k_(?:live|test)_[A-Za-z0-9]{16,})"
    r"|(?<![A-Za-z0-9])(?:sk-[A-Za-z0-9_-]{20,}|AIza[0-9A-Za-z_-]{35}|npm_[A-Za-z0-9]{36}|hv[sbr]\.[A-Za-z0-9_-]{20,})"
    r"|(?<![A-Za-z0-9])pypi-[A-Za-z0-9_-]{50,}"
)
# Hex digests named as such (`sha256:...`, image digests) are content addresses, not secrets.
_HEX = re.compile(
    r"(?<![A-Za-z0-9])(?<!sha1:)(?<!sha224:)(?<!sha256:)(?<!sha384:)(?<!sha512:)(?<!md5:)[0-9a-fA-F]{32,}"
)
_BLOB = re.compile(r"(?<![A-Za-z0-9+/_\-])[A-Za-z0-9+/_\-]{32,}={0,2}")
_BLOB_ENTROPY = 4.1  # bits per character: random base64 of 32 characters averages 4.5, words and paths 3.5-4.1
# `name=value` (query strings, `a=b,password=c`, libpq keyword strings) and `name: value` / `"name": "value"`.
_EQ_NAME = re.compile(r"(?<![A-Za-z0-9_.])(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)[ \t]*=(?!=)[ \t]*")
_COLON_NAME = re.compile(
    r"(?<![A-Za-z0-9_./])(?P<q>[\"']?)(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)(?P=q)[ \t]*:(?!//)[ \t]*"
)
_VALUE = re.compile(r"\"(?:[^\"\\]|\\.)*\"?|'[^']*'?|[^\s,;&'\"]+", re.S)

# ---- layer 2: words ---------------------------------------------------------------------------

# Shell words, and what separates them: white space and unquoted operators (`;`, `&&`, `|`, `>`, ...).
_WORD = re.compile(r"(?P<gap>\s+|[;&|<>()]+)|(?:[^\s'\"\\;&|<>()]|\\.?|'[^']*'?|\"(?:[^\"\\]|\\.)*\"?)+", re.S)
_PAIR = re.compile(r"(?P<dash>-{0,2})(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)=(?P<value>.*)", re.S)
_OPTION = re.compile(r"(?P<dash>-{1,2})(?P<name>[A-Za-z0-9][A-Za-z0-9_.\-]*)")
_SHORT = re.compile(r"-(?P<letter>[A-Za-z0-9])(?P<rest>.*)", re.S)
_HEADER = re.compile(r"\s*(?:-H\s*)?(?P<name>[A-Za-z][A-Za-z0-9_\-]*)[ \t]*:(?!//)[ \t]*(?P<value>.*)", re.S)
_IDENTITY_TEXT = re.compile(r"\s*IdentityFile(?:\s*=\s*|\s+)(?P<value>.*)", re.S | re.I)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_OPTION_LIKE = re.compile(r"--[A-Za-z][A-Za-z0-9\-]*(?:=.*)?|-[A-Za-z]", re.S)  # not taken as an option's value
_SHELL_C = re.compile(r"-[A-Za-z]*c[A-Za-z]*")  # sh -c, bash -lc: the next argument is a command string
_HTPASSWD_BATCH = re.compile(r"-[A-Za-z]*b[A-Za-z]*")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*", re.S)
_SPACE = re.compile(r"\s")
_QUOTED = re.compile(r"'[^']*'|\"(?:[^\"\\]|\\.)*\"", re.S)
_PATH_LIKE = re.compile(r"[~.]|.*/|.*\.(?:pem|key|ppk)$|id_", re.S)  # `-i` outside ssh: a value like a key file


@dataclass
class _State:
    """What scrubbing one command line has learnt so far."""

    extra: tuple[re.Pattern[str], ...]
    program: str = ""  # context from the last known program word (`ssh`, `curl`, `login`, ...)
    pending: str = ""  # action for the next word: the previous one was a secret option expecting a value
    previous: str = ""  # previous word, lower-cased (for `set NAME VALUE`)
    shell_next: bool = False  # the next argument is a shell command string (after `sh -c`)
    redact_rest: bool = False  # `htpasswd -b`: the password is positional, so everything after goes

    def kind(self, name: str, dashed: bool = False) -> str:
        """The action for the value of an option or key called `name` ('' when it is not secret)."""
        name = name.lstrip("-")
        kind = _builtin_kind(name, dashed)
        if not kind and any(pattern.search(name) for pattern in self.extra):
            return _SECRET
        return kind


@functools.lru_cache(maxsize=1024)
def _builtin_kind(name: str, dashed: bool) -> str:
    lower = name.lower()
    normal = re.sub(r"[-_.]", "", lower)
    if normal in _NOT_SECRET:
        return ""
    if _IDENTITY_NAME.fullmatch(normal):
        return _IDENTITY
    if dashed and normal in _USER_OPTIONS:
        return _USER
    return _SECRET if _SECRET_NAME.search(lower) else ""


_PLAIN_PATH = re.compile(r"[\w./+-]{1,256}")  # a bare path: no shell words, no `NAME=`, no user info


def executable_name(program: object) -> str:
    """Basename of the executable (str, bytes, os.PathLike, or a shell command string -> first word's basename).

    Never raises: odd input (None, ints, non-UTF-8 bytes, empty) gives a safe string like "?"; bytes are
    decoded with errors="backslashreplace"; the result is at most `MAX_NAME_CHARS` characters. A shell
    command's leading `NAME=value` words are skipped, so `PGPASSWORD=x psql -h db` gives "psql". A string
    with white space is read as a shell command, so an executable path containing spaces gives its first word.
    """
    try:
        if type(program) is str and _PLAIN_PATH.fullmatch(program):  # the usual case, the same few paths
            return _executable_name_of_path(program)
        return _executable_name(program)
    except Exception:  # not cached: a failure is not the name
        return "?"


def loop_command(args: Sequence[Any], shell: bool) -> tuple[object, Sequence[object]]:
    """The program and argv of a loop's `subprocess_exec(protocol_factory, program, *args)` or
    `subprocess_shell(protocol_factory, cmd)` call, given its arguments after the loop: a shell
    command line is one argument."""
    return args[1], (args[1:2] if shell else args[1:])


def args_count(argv: Sequence[object]) -> int:
    """`process.args_count` of a spawn of `argv`, on its span and in the freeze record: every
    argument, the program included."""
    return len(argv)


@functools.lru_cache(maxsize=256)
def _executable_name_of_path(program: str) -> str:
    """Cached only for bare paths: a shell command line may hold secrets, which no cache keeps."""
    return _executable_name(program)


def _executable_name(program: object) -> str:
    if not isinstance(program, (str, bytes, bytearray, os.PathLike)):
        return "?"
    text, _ = _to_text(program)
    words: Iterable[str] = [text]
    if _SPACE.search(text):  # a shell command
        words = (_unquote(match.group()) for match in _WORD.finditer(text) if not match["gap"])
    first = next((word for word in words if not _ASSIGNMENT.fullmatch(word)), "")
    first = _userinfo(first).rstrip("/")
    return first.rpartition("/")[2][:MAX_NAME_CHARS] or "?"


def compile_patterns(text: str, setting: str = "STALLWATCH_SCRUB_PATTERNS") -> tuple[re.Pattern[str], ...]:
    """Extra secret-name patterns from a setting: comma-separated regular expressions (so none may contain a
    comma), matched case-insensitively against option / KEY names. Empty string -> (). An invalid regex raises
    ValueError whose message names `setting` and the bad pattern (scrubbed)."""
    patterns: list[re.Pattern[str]] = []
    for part in text.split(","):
        source = part.strip()
        if not source:
            continue
        try:
            patterns.append(re.compile(source, re.IGNORECASE))
        except (re.error, OverflowError, RecursionError) as exc:  # `a{99999999999}` overflows, deep nesting recurses
            shown = scrub_text(source)  # the message goes to the host's log: a pattern may hold a secret
            raise ValueError(f"{setting}: {shown!r} is not a valid regular expression ({exc})") from None
    return tuple(patterns)


def scrub_args(args: Sequence[object], extra: Sequence[re.Pattern[str]] = ()) -> list[str]:
    """Command-line arguments (argv incl. argv[0]) with secrets replaced by "[REDACTED]". Never raises.

    Arguments may be str, bytes (decoded with backslashreplace), os.PathLike or anything else (str()'d).
    At most `MAX_ARGS` elements come back (the last then says how many more there were), each at most
    `MAX_ARG_CHARS` characters. argv[0] is kept as is apart from URL user-info, unless it holds white space
    (a shell command string) or looks like an option or `NAME=value` rather than a program: then it is
    scrubbed like any argument. `extra` adds secret-name patterns (see `compile_patterns`).
    """
    try:
        return _scrub(args, extra)
    except Exception:
        return [UNSCRUBBABLE]


def scrub_text(value: object, limit: int = MAX_ARG_CHARS) -> str:
    """Free text from the host (a tunnel's destination, an exception message, a setting's bad value) made fit
    for an attribute or a log line: secrets replaced as in one command-line argument, valid UTF-8, at most
    `limit` characters (never more than `MAX_ARG_CHARS`; a cut value ends in "...[truncated]"). Accepts what
    `scrub_args` accepts for one argument. Never raises: "?" if scrubbing itself fails.
    """
    try:
        return _clip(_argument(1, value, _State(())), limit)
    except Exception:
        return "?"


def clip_text(value: object, limit: int = MAX_NAME_CHARS) -> str | None:
    """An identifier from the host or a server (a resource, operation or request id, an rpc name) made fit for
    an attribute: None unless `value` is a non-empty str, else valid UTF-8 of at most `limit` characters.

    Not scrubbed: ids are not secrets, and a 32-digit trace id would look like one. Never raises.
    """
    try:
        if type(value) is str and 0 < len(value) <= limit and len(value) <= MAX_ARG_CHARS and value.isascii():
            return value  # what the general path below returns for it, in a fifth of the time
        if not isinstance(value, str) or not value:
            return None
        text = str.__str__(value[: _bound(limit) + 1])  # the rest would be cut anyway
        return _clip(str.encode(text, "utf-8", "backslashreplace").decode("utf-8"), limit)
    except Exception:
        return None


def _bound(limit: int) -> int:
    """`limit` within what a caller may ask: at most `MAX_ARG_CHARS`, room for the truncation marker."""
    return max(min(limit, MAX_ARG_CHARS), 2 * len(TRUNCATED))


def _clip(text: str, limit: int) -> str:
    limit = _bound(limit)
    return text if len(text) <= limit else text[: limit - len(TRUNCATED)] + TRUNCATED


def _scrub(args: object, extra: object) -> list[str]:
    known = True  # whether the number of arguments is known
    if isinstance(args, (str, bytes, bytearray, memoryview, os.PathLike)) or not isinstance(args, Iterable):
        items, total = [args], 1
    else:
        try:
            total = len(args)  # type: ignore[arg-type]
        except Exception:  # an iterable without a length
            items = list(itertools.islice(args, MAX_ARGS + 1))
            total, known = len(items), False
        else:
            items = list(itertools.islice(args, min(total, MAX_ARGS)))
    patterns = tuple(p for p in _iterate(extra) if isinstance(p, re.Pattern) and isinstance(p.pattern, str))
    state = _State(patterns)
    shown = items if total <= MAX_ARGS else items[: MAX_ARGS - 1]
    result = [_argument(index, item, state) for index, item in enumerate(shown)]
    if total > MAX_ARGS:
        result.append(f"[... {total - len(shown)} more]" if known else "[... more]")
    return result


def _iterate(values: object) -> Iterable[object]:
    if isinstance(values, re.Pattern):
        return (values,)
    if isinstance(values, Iterable) and not isinstance(values, (str, bytes)):
        return itertools.islice(values, 1000)
    return ()


def _to_text(value: object) -> tuple[str, bool]:
    """The argument as text of at most `_SCAN_CHARS` characters, and whether it was cut."""
    beyond = False  # bytes left undecoded
    try:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, str):
            text = str.__str__(value)
        elif isinstance(value, (bytes, bytearray, memoryview)):
            raw = memoryview(value).cast("B")
            text = raw[: _SCAN_CHARS * 4].tobytes().decode("utf-8", "backslashreplace")
            beyond = len(raw) > _SCAN_CHARS * 4
        else:
            text = str.__str__(str(value))
    except Exception:  # a hostile __str__ / __fspath__, a memoryview that cannot be cast
        text = "?"
    cut = beyond or len(text) > _SCAN_CHARS
    if cut:
        # Never keep the start of a cut word: it may be half a secret that no rule recognises any more.
        at_boundary = len(text) > _SCAN_CHARS and text[_SCAN_CHARS].isspace()
        text = text[:_SCAN_CHARS]
        if not at_boundary:
            text = text[: max((match.end() for match in _SPACE.finditer(text)), default=0)]
    # lone surrogates (from os.fsdecode and the like) would make exporters fail to encode the span
    return str.encode(text, "utf-8", "backslashreplace").decode("utf-8"), cut


def _argument(index: int, value: object, state: _State) -> str:
    text, cut = _to_text(value)
    shell, state.shell_next = state.shell_next, False
    if state.redact_rest:
        return REDACTED
    if state.pending:
        action, state.pending = state.pending, ""
        consumed = _consume(action, text)
        if consumed is not None:
            state.previous = ""
            return _limit(consumed, cut)
    if index == 0 and not (_SPACE.search(text) or _PAIR.match(text) or text.startswith("-")):
        state.program = _PROGRAMS.get(text.rpartition("/")[2].lower(), "")
        return _limit(_userinfo(text), cut)
    text = _inline(text, state)
    whole = None if shell or index == 0 else _whole_value(text, state)
    if whole is not None:
        result = whole
    else:
        result = _text(text, state, 0)
        state.shell_next = state.program == "shell" and _SHELL_C.fullmatch(text) is not None
    if cut:
        state.pending = ""  # the cut word was the option's value
    return _limit(result, cut)


def _limit(text: str, cut: bool) -> str:
    if cut or len(text) > MAX_ARG_CHARS:
        return text[: MAX_ARG_CHARS - len(TRUNCATED)] + TRUNCATED
    return text


def _whole_value(text: str, state: _State) -> str | None:
    """An argument that is one secret `--name=value` / `KEY=VALUE` / `IdentityFile path`: its value is
    everything after the name, white space included (`env "PGPASSWORD=correct horse" psql`)."""
    match = _PAIR.match(text)
    kind = state.kind(match["name"], bool(match["dash"])) if match else ""
    if match and kind:
        state.previous = ""
        return text[: match.start("value")] + _apply(kind, match["value"])
    match = _IDENTITY_TEXT.fullmatch(text)
    if match:
        return text[: match.start("value")] + _apply(_IDENTITY, match["value"])
    return None


# ---- layer 1 -------------------------------------------------------------------------------------


def _userinfo(text: str) -> str:
    """Remove the user-info of URLs (`scheme://user:password@host`) and of bare `user:password@host`."""
    if "@" not in text:
        return text
    parts: list[str] = []
    position = 0
    for scheme in _SCHEME.finditer(text):
        start = scheme.end()
        if start < position:
            continue
        space = _SPACE.search(text, start)
        at = _userinfo_end(text[start : space.start() if space else len(text)])
        if at >= 0:
            parts += [text[position:start], REDACTED]
            position = start + at
    parts.append(text[position:])
    return _BARE_USERINFO.sub(f"{REDACTED}@", "".join(parts))


def _userinfo_end(url: str) -> int:
    """Where the user-info of `url` (what follows `scheme://`) ends at an `@`; -1 if it has none."""
    authority = min((i for i in (url.find("/"), url.find("?"), url.find("#")) if i >= 0), default=len(url))
    at = url.rfind("@", 0, authority)  # the last @: an unencoded @ in the password stays in the user-info
    if at < 0 and ":" in url[:authority]:
        at = url.find("@", authority)  # an unencoded / ? or # in the password: a broken URL, redacted all the same
    return at


def _inline(text: str, state: _State) -> str:
    text = _PEM.sub(REDACTED, text)
    text = _userinfo(text)
    text = _AUTH_SCHEME.sub(lambda match: match[1] + match[2] + REDACTED, text)
    text = _SQL_PASSWORD.sub(lambda match: match[1] + match[2] + REDACTED, text)
    text = _TOKENS.sub(REDACTED, text)
    text = _HEX.sub(_hex_blob, text)
    text = _BLOB.sub(_base64_blob, text)
    text = _named_values(text, _EQ_NAME, state)
    return _named_values(text, _COLON_NAME, state)


def _hex_blob(match: re.Match[str]) -> str:
    run = match.group()
    if any(c.isdigit() for c in run) and any(c.isalpha() for c in run):
        return REDACTED
    return run


def _base64_blob(match: re.Match[str]) -> str:
    run = match.group()
    mixed = any(c.isdigit() for c in run) and any(c.islower() for c in run) and any(c.isupper() for c in run)
    if mixed and _entropy(run) >= _BLOB_ENTROPY:
        return REDACTED
    return run


def _entropy(text: str) -> float:
    size = len(text)
    return -sum(n / size * math.log2(n / size) for n in Counter(text).values())


def _named_values(text: str, pattern: re.Pattern[str], state: _State) -> str:
    """Redact the value after each secret-named `name=` / `name:` in `text`."""
    parts: list[str] = []
    position = 0
    for match in pattern.finditer(text):
        if match.start() < position or state.kind(match["name"]) != _SECRET:
            continue
        value = _VALUE.match(text, match.end())
        if value is None:
            continue
        parts += [text[position : match.end()], REDACTED]
        position = value.end()
    parts.append(text[position:])
    return "".join(parts)


# ---- layer 2 -------------------------------------------------------------------------------------


def _text(text: str, state: _State, depth: int) -> str:
    """Scrub text made of shell words (one argument, a quoted word's content, a `KEY=VALUE` value)."""
    if depth > _MAX_DEPTH:
        return REDACTED
    header = _HEADER.match(text)
    if header and state.kind(header["name"]) == _SECRET:
        if header["value"].strip():
            return text[: header.start("value")] + REDACTED
        state.pending = _SECRET
        return text
    parts: list[str] = []
    for match in _WORD.finditer(text):
        if match["gap"] and not match["gap"].isspace():
            state.pending = ""  # `--password; next-command`: the option got no value
        parts.append(match.group() if match["gap"] else _word(match.group(), state, depth))
    return "".join(parts)


def _word(raw: str, state: _State, depth: int) -> str:
    if state.redact_rest:
        return REDACTED
    plain = _unquote(raw)
    if state.pending:
        action, state.pending = state.pending, ""
        consumed = _consume(action, plain)
        if consumed is not None:
            state.previous = ""
            return consumed
    result = _rules(raw, plain, state, depth)
    state.previous = plain.lower()
    return result


def _rules(raw: str, plain: str, state: _State, depth: int) -> str:
    """One word: `raw` as written, `plain` with its shell quoting removed."""
    if not plain.startswith("-"):
        program = _PROGRAMS.get(plain.rpartition("=")[2].rstrip("/").rpartition("/")[2].lower())
        if program:
            state.program = program
    elif state.program == "htpasswd" and _HTPASSWD_BATCH.fullmatch(plain):
        state.redact_rest = True
        return raw
    short = _short_option(plain, state, depth)
    if short is not None:
        return short
    pair = _PAIR.fullmatch(plain)
    if pair:
        return _pair(raw, pair, state, depth)
    option = _OPTION.fullmatch(plain)
    if option:
        _option(option, state)
        return raw
    header = _HEADER.fullmatch(plain)
    if header and state.kind(header["name"]) == _SECRET:
        if header["value"]:
            scrubbed = plain[: header.start("value")] + REDACTED
            return _requote(raw, scrubbed) if _QUOTED.fullmatch(raw) else scrubbed
        state.pending = _SECRET
        return raw
    if plain.lower() == "identityfile":
        state.pending = _IDENTITY
    elif state.previous in _SETTERS and _IDENTIFIER.fullmatch(plain) and state.kind(plain) == _SECRET:
        state.pending = _SECRET  # aws configure set aws_secret_access_key VALUE, git config NAME VALUE
    elif plain != raw and _SPACE.search(plain):  # quoted text holding several words
        inner = _text(plain, state, depth + 1)
        if inner != plain:
            return _requote(raw, inner)
    return raw


def _short_option(plain: str, state: _State, depth: int) -> str | None:
    """Context-dependent single-letter options (`ssh -i`, `sshpass -p`, `curl -u`); None if not one."""
    match = _SHORT.fullmatch(plain)
    if not match:
        return None
    letter, rest = match["letter"], match["rest"]
    if state.program == "ssh":
        scrubbed = _ssh_cluster(plain, state, depth)
        option = _OPTION.fullmatch(plain)
        if scrubbed is not None and option:  # also a secret option of a remote command? (`ssh h cmd -sig X`)
            _option(option, state)
        return scrubbed
    if letter == "i":  # an identity file outside ssh's own options: only values that look like paths
        if not rest:
            state.pending = _MAYBE_IDENTITY
            return plain
        return "-i" + _fingerprint(rest) if "/" in rest else None
    action, separate = _SHORT_OPTIONS.get(state.program, {}).get(letter, ("", False))
    if not action:
        return None
    if rest:
        return "-" + letter + _apply(action, rest)
    if separate:
        state.pending = action
    return plain


def _ssh_cluster(plain: str, state: _State, depth: int) -> str | None:
    """getopt for ssh's short options (`-NTi key`, `-iKEY`, `-oIdentityFile=key`); None if nothing to scrub,
    leaving the word to the other rules."""
    for index in range(1, len(plain)):
        letter = plain[index]
        if not letter.isalnum():
            return None
        if letter in _SSH_FLAGS_WITH_VALUE:
            head, rest = plain[: index + 1], plain[index + 1 :]
            if letter == "i" and rest:
                return head + _fingerprint(rest)
            if letter == "i":
                state.pending = _IDENTITY
                return plain
            if letter == "o" and rest:
                scrubbed = _rules(rest, rest, state, depth)
                return head + scrubbed if scrubbed != rest else None
            return None
    return None


def _pair(raw: str, pair: re.Match[str], state: _State, depth: int) -> str:
    """`--name=value`, `-Dname=value`, `KEY=VALUE` (`plain` is `pair.string`)."""
    prefix, value = pair.string[: pair.start("value")], pair["value"]
    kind = state.kind(pair["name"], bool(pair["dash"]))
    if kind:
        return prefix + _apply(kind, value)
    inner = _text(value, state, depth + 1)
    if inner == value:
        return raw
    return prefix + _requote(raw[raw.index("=") + 1 :], inner)


def _requote(raw: str, text: str) -> str:
    """`text` in the quotes `raw` started with, if it did."""
    quote = raw[:1]
    return quote + text + quote if quote in ("'", '"') else text


def _option(option: re.Match[str], state: _State) -> None:
    """`--name` (or `-name`) whose value is the next word."""
    name = option["name"]
    lower = name.lower()
    if len(name) < 2 or lower.startswith(("no-", "no_")) or lower.endswith("stdin"):
        return
    if re.sub(r"[-_.]", "", lower) in _VALUELESS:
        return
    state.pending = state.kind(name, True) or state.pending


def _consume(action: str, value: str) -> str | None:
    """`value` as the value of the previous word's option, scrubbed by `action`; None if it is not that value
    (it looks like another option, a `-i` value is no path, a `-u` value no `user:password`), leaving it to
    the other rules."""
    if _OPTION_LIKE.fullmatch(value):
        return None
    if action == _MAYBE_IDENTITY and not _PATH_LIKE.match(value):
        return None
    if action == _USER and ":" not in value:
        return None
    return _apply(action, value)


def _apply(action: str, value: str) -> str:
    if action in (_IDENTITY, _MAYBE_IDENTITY):
        return _fingerprint(value)
    if action == _USER:
        user, colon, _ = value.partition(":")
        return user + colon + REDACTED if colon else value
    return REDACTED if value else value


def _fingerprint(path: str) -> str:
    """`key:` and 12 hex digits of the SHA-256 of the file name: the same key is recognisable, its path is not."""
    path = path.strip().strip("'\"").rstrip("/")
    name = path.rpartition("/")[2] or path
    return "key:" + hashlib.sha256(name.encode("utf-8", "backslashreplace")).hexdigest()[:12]


def _unquote(word: str) -> str:
    """A shell word without its quoting: 'a b' -> a b, "a\\"b" -> a"b, a\\ b -> a b."""
    if not any(c in word for c in "'\"\\"):
        return word
    out: list[str] = []
    index, size = 0, len(word)
    while index < size:
        char = word[index]
        if char == "'":
            end = word.find("'", index + 1)
            end = size if end < 0 else end
            out.append(word[index + 1 : end])
            index = end + 1
        elif char == '"':
            index += 1
            while index < size and word[index] != '"':
                if word[index] == "\\" and index + 1 < size and word[index + 1] in '"\\$`':
                    index += 1
                out.append(word[index])
                index += 1
            index += 1
        elif char == "\\" and index + 1 < size:
            out.append(word[index + 1])
            index += 2
        else:
            out.append(char)
            index += 1
    return "".join(out)
