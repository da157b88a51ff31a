"""Scrub secrets out of what stallwatch records from the host: child command lines, free text, and every
string once more as it leaves the process.

A child's argv (or a shell's command string) becomes the span attribute `process.command_args` only
with `STALLWATCH_RECORD_ARGS=true`; what is recorded has credentials replaced with `[REDACTED]`
(identity files with a short fingerprint of their file name) and is bounded in size.

Contract: uses only the standard library and never raises. The policy is to leak nothing, at the
price of sometimes hiding a harmless value; docs/scrubbing.md lists every rule and what is kept.
Two layers, each catching what the other misses: shapes anywhere in an argument (key material, URL
user-info, `Bearer`/`Basic` credentials, known token layouts, random-looking runs, secret-named
`name=value` pairs), and structure word by word with shell quoting understood (`--name=value`,
`--name value`, `KEY=VALUE`, headers, identity files, the credential options of known tools).
`scrub_value` / `scrub_attributes` apply the same rules to strings leaving the process (the exit
check), leaving scrubbed text as it is.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import operator
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from .. import telemetry

_PATTERN_ATTRIBUTES = ("match", "fullmatch", "search", "sub", "subn", "split", "finditer", "findall", "flags", "groups",
                       "groupindex")  # fmt: skip


class _LazyPattern:
    """A module pattern compiled at its first use: the scrubber's patterns cost a few milliseconds to
    compile, which a host that never scrubs (or not yet) does not pay at `import stallwatch`. After the
    first attribute read, the compiled pattern's attributes are the instance's own, read as fast as the
    pattern's. Two threads compiling it at once each get an equal pattern."""

    def __init__(self, source: str, flags: int) -> None:
        self._source = source
        self._flags = flags
        self.pattern = source

    def __getattr__(self, name: str) -> Any:
        compiled = re.compile(self._source, self._flags)
        for attribute in _PATTERN_ATTRIBUTES:
            setattr(self, attribute, getattr(compiled, attribute))
        return getattr(compiled, name)


def _pattern(source: str, flags: int = 0) -> re.Pattern[str]:
    """`re.compile(source, flags)`, compiled at its first use (`_LazyPattern`)."""
    return cast("re.Pattern[str]", _LazyPattern(source, flags))


MAX_ARGS = 64  # arguments recorded; beyond, the last recorded element says how many were left out
MAX_ARG_CHARS = 512  # characters recorded per argument, truncation marker included
MAX_NAME_CHARS = 128  # characters of an executable name
REDACTED = "[REDACTED]"
TRUNCATED = "...[truncated]"
UNSCRUBBABLE = "[arguments could not be scrubbed]"  # the whole result if scrubbing itself failed

_SHORTEST_SECRET = 12  # a shorter value can only hold a secret next to `=`, `:`, `@` or a space (`scrub_value`)
_SEPARATES = _pattern(r"[=:@\s]")
_PLAIN_WORDS = _pattern(r"[A-Za-z0-9_.() ]*")  # no option dash, no `=`, `:`, `@`, `/`, quote
_LONG_WORD = _pattern(r"[A-Za-z0-9_.]{20}")  # every token shape but a JWT's is longer; a JWT starts `eyJ`
_CLEAN_VALUES_LIMIT = 4096  # values `scrub_value` found clean, kept until there are this many, then forgotten
_clean_values: dict[str, None] = {}
_clean_lists: dict[tuple[str, ...], None] = {}  # the same, for argument lists (`scrub_attributes`)
_SCAN_CHARS = 2 * MAX_ARG_CHARS  # an argument is cut to this many characters (at a word boundary) first
_MAX_DEPTH = 8  # nesting of quoted words / KEY=VALUE values; deeper text is redacted whole

# Actions for the value of a secret-named option or key.
_SECRET = "secret"  # replace the value with [REDACTED]
_IDENTITY = "identity"  # replace the path with key:<fingerprint of its file name>
_USER = "user:"  # `user:password` (curl): redact what follows the first colon
_USER_PERCENT = "user%"  # `user%password` (smbclient, rpcclient, net)
_USER_COMMA = "user,"  # `user,password` (lftp)
_USER_SLASH = "user/"  # `user/password@database` (sqlplus, rman, expdp ...): keep the user and the database
_MAYBE_IDENTITY = "maybe-identity"  # `-i` outside ssh: an identity file if it looks like a path

# Option / key names whose value is secret: searched (lower-cased, dashes kept) in the name.
_SECRET_NAME = _pattern(
    r"passw|pwd|passphrase|pass(?![a-z])|pass(?:in|out|code|key)|token|secret|key|credential"
    r"|auth(?!ors?(?![a-z])|ority|orities)|cookie|session|signature|(?<![a-z])sig(?![a-z])|bearer|jwt|dsn"
    r"|(?<![a-z])(?:pat|otp|psk)(?![a-z])"
)
# What makes a rule fire in plain words: a secret's name (nmcli's `password VALUE`, `set token VALUE`), an
# authorization scheme, `IdentityFile PATH`, a JWT.
_TRIGGERS = _pattern(_SECRET_NAME.pattern + r"|bearer|basic|identityfile|eyj")
# Names (lower-cased, without `-_.`) that contain a secret word but never carry a secret value:
# ssh options taking yes/no or algorithm lists, and flags that take no value at all.
_NOT_SECRET = frozenset(
    {
        "addkeystoagent",
        "authenticationdatabase",
        "authenticationmechanism",
        "authmechanism",
        "authsource",
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
_IDENTITY_NAME = _pattern(r"o?identity(?:file)?")  # normalised; `o` for `-oIdentityFile=`
_USER_OPTIONS = frozenset({"user", "proxyuser", "cert", "proxycert"})  # `--user name:password`
_SETTERS = frozenset({"set", "config", "--global", "--local", "--system", "--worktree", "--add", "--replace-all"})

# Known programs (basename, lower-cased) -> the context their short options are read in.
_PROGRAMS = {
    name: context
    for context, names in (
        ("ssh", ("ssh", "scp", "sftp", "autossh", "sshfs", "ssh-copy-id", "plink", "pscp", "psftp")),
        ("shell", ("sh", "bash", "dash", "zsh", "ksh", "ash", "fish")),
        (
            "mysql",
            (
                "mysql",
                "mysqldump",
                "mysqladmin",
                "mysqlimport",
                "mysqlcheck",
                "mysqlshow",
                "mysqlbinlog",
                "mysqlpump",
                "mysqlslap",
                "mariadb",
                "mariadb-dump",
                "mariadb-admin",
                "mariadb-import",
                "mariadb-check",
            ),
        ),
        (
            "mongo",
            (
                "mongo",
                "mongosh",
                "mongodump",
                "mongorestore",
                "mongoexport",
                "mongoimport",
                "mongostat",
                "mongotop",
                "mongofiles",
            ),
        ),
        ("smb", ("smbclient", "rpcclient", "smbcacls", "smbget", "smbtree", "smbcquotas", "net", "winexe", "wbinfo")),
        (
            "snmp",
            (
                "snmpwalk",
                "snmpbulkwalk",
                "snmpget",
                "snmpbulkget",
                "snmpgetnext",
                "snmpset",
                "snmptable",
                "snmptrap",
                "snmpinform",
                "snmpdelta",
                "snmpstatus",
                "snmpdf",
            ),
        ),
        ("freerdp", ("xfreerdp", "xfreerdp3", "wlfreerdp", "wlfreerdp3", "sdl-freerdp", "sdl-freerdp3")),
        ("oracle", ("sqlplus", "rman", "expdp", "impdp", "sqlldr", "dgmgrl")),
        ("ncftp", ("ncftp", "ncftpget", "ncftpput", "ncftpls")),
        ("mosquitto", ("mosquitto_pub", "mosquitto_sub", "mosquitto_rr")),
        ("rar", ("rar", "unrar")),
        ("smbmap", ("smbmap",)),
        ("lftp", ("lftp",)),
        ("ipmitool", ("ipmitool",)),
        ("rdesktop", ("rdesktop",)),
        ("nmcli", ("nmcli",)),
        ("git", ("git",)),
        ("ldap", ("ldapsearch", "ldapadd", "ldapmodify", "ldapdelete", "ldapwhoami", "ldappasswd")),
        ("zip", ("zip", "unzip")),
        ("7z", ("7z", "7za", "7zr")),
        ("useradd", ("useradd", "usermod")),
        ("sshpass", ("sshpass",)),
        ("curl", ("curl",)),
        ("openssl", ("openssl",)),
        ("redis-cli", ("redis-cli", "keydb-cli", "valkey-cli")),
        ("sqlcmd", ("sqlcmd", "bcp", "osql")),
        ("htpasswd", ("htpasswd",)),
        ("login", ("login",)),  # docker/podman/helm/az/oc ... login
    )
    for name in names
}
# Per context, the short options whose value is secret: letter(s) after the dash -> (action, value may be separate).
# A value glued to the option (`-pS3cret`) is always scrubbed; a lone `-p` of mysql, 7z or rar prompts for the
# password, so the next word stays.
_SHORT_OPTIONS: dict[str, dict[str, tuple[str, bool]]] = {
    "sshpass": {"p": (_SECRET, True)},
    "login": {"p": (_SECRET, True)},  # docker/podman/helm/az/oc ... login -p
    "curl": {"u": (_USER, True), "U": (_USER, True), "E": (_USER, True), "b": (_SECRET, True)},
    "mysql": {"p": (_SECRET, False)},
    "openssl": {"k": (_SECRET, True), "K": (_SECRET, True)},
    "redis-cli": {"a": (_SECRET, True)},
    "sqlcmd": {"P": (_SECRET, True)},
    "ldap": {"w": (_SECRET, True)},
    "zip": {"P": (_SECRET, True)},
    "7z": {"p": (_SECRET, False)},
    "rar": {"p": (_SECRET, False), "hp": (_SECRET, False)},
    "useradd": {"p": (_SECRET, True)},
    "mongo": {"p": (_SECRET, True)},
    "smb": {"U": (_USER_PERCENT, True)},
    "smbmap": {"p": (_SECRET, True)},
    "lftp": {"u": (_USER_COMMA, True)},
    "ncftp": {"p": (_SECRET, True)},
    "ipmitool": {"P": (_SECRET, True), "k": (_SECRET, True), "y": (_SECRET, True)},
    "mosquitto": {"P": (_SECRET, True)},
    "snmp": {"A": (_SECRET, True), "X": (_SECRET, True), "c": (_SECRET, True)},  # auth, privacy, community
    "rdesktop": {"p": (_SECRET, True)},
}
_SSH_FLAGS_WITH_VALUE = "BbcDEeFIiJLlmOoPpQRSWw"

# ---- layer 1: shapes anywhere in an argument ----------------------------------------------------

_SCHEME = _pattern(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://")
_BARE_USERINFO = _pattern(r"(?<![\w.%+\-/:@\[])[\w.%+\-~]+:[^\s@/]+@(?!sha\d+:)(?=[\w\[])")
# Private key material: PEM and PGP armour (to the END line, or to the end if it is missing), PuTTY key files.
_PEM = _pattern(
    r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|\Z)"
    r"|PuTTY-User-Key-File-[0-9]+:.*",
    re.S,
)
_AUTH_SCHEME = _pattern(r"(?i)(?<![A-Za-z0-9])(bearer|basic)(\s+)[^\s'\"]+")
_SQL_PASSWORD = _pattern(r"(?i)(?<![\w-])(password|identified\s+by)(\s+)'(?:[^']|'')*'?")  # ... PASSWORD 'x'
# Token shapes with a known prefix or layout, after the rule sets of gitleaks and detect-secrets (docs/scrubbing.md).
_TOKENS = _pattern(
    r"eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}(?:\.[A-Za-z0-9_-]*)*"  # JWT (JWS, JWE), Grafana API key
    r"|(?:(?<![A-Za-z0-9])|(?<=(?<![A-Za-z0-9])-[A-Za-z]))(?:"  # a word's start, or glued to a short option
    r"(?:A3T[A-Z0-9]|AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}(?![A-Za-z0-9])"  # AWS access key id
    r"|gh[pousr]_[A-Za-z0-9_]{20,}|github_pat_[A-Za-z0-9_]{20,}"  # GitHub
    r"|gl(?:pat|dt|ft|soat|rt|cbt|ptt|agent|oas|imt|ffct)-[A-Za-z0-9_.-]{20,}|GR1348941[A-Za-z0-9_-]{20,}"  # GitLab
    r"|glc_[A-Za-z0-9+/]{32,}={0,3}|glsa_[A-Za-z0-9_]{32,}"  # Grafana
    r"|xox[abeoprs]-[A-Za-z0-9-]{10,}|xoxe\.xox[bp]-[A-Za-z0-9-]{10,}|xapp-[0-9]-[A-Za-z0-9-]{10,}"  # Slack
    r"|[sr]k_(?:live|test|prod)_[A-Za-z0-9]{10,}|whsec_[A-Za-z0-9]{20,}"  # Stripe
    r"|sk-[A-Za-z0-9_-]{20,}"  # OpenAI, Anthropic and the many APIs that copied the prefix
    r"|AIza[0-9A-Za-z_-]{35}|ya29\.[0-9A-Za-z_-]{20,}|GOCSPX-[0-9A-Za-z_-]{20,}|1//0[0-9A-Za-z_-]{30,}"  # Google
    r"|npm_[A-Za-z0-9]{36}|pypi-[A-Za-z0-9_-]{50,}|rubygems_[a-f0-9]{48}"  # package registries
    r"|hv[sbr]\.[A-Za-z0-9_-]{20,}|hf_[A-Za-z]{30,}|api_org_[A-Za-z]{30,}"  # Vault, Hugging Face
    r"|SG\.[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,}|SK[0-9a-fA-F]{32}"  # SendGrid, Twilio
    r"|dapi[a-f0-9]{32}|do[opr]_v1_[a-f0-9]{64}|dp\.(?:pt|st|ct|sa|scim|audit)\.[A-Za-z0-9]{40,}"  # Databricks, ...
    r"|dt0c01\.[A-Za-z0-9]{24}\.[A-Za-z0-9]{64}|shp(?:at|ca|pa|ss)_[a-fA-F0-9]{32}"  # Dynatrace, Shopify
    r"|pscale_(?:tkn|oauth|pw)_[A-Za-z0-9_.=-]{32,}|PMAK-[a-fA-F0-9]{24}-[a-fA-F0-9]{34}"  # PlanetScale, Postman
    r"|pul-[a-f0-9]{40}|pnu_[A-Za-z0-9]{36}|rdme_[a-z0-9]{70}|sntry[us]_[A-Za-z0-9_+/=]{40,}"  # Pulumi, ... Sentry
    r"|lin_api_[A-Za-z0-9]{40}|ntn_[0-9]{11}[A-Za-z0-9]{35}|HRKU-[A-Za-z0-9_-]{20,}"  # Linear, Notion, Heroku
    r"|AGE-SECRET-KEY-1[0-9A-Z]{58}|sq0(?:atp|csp)-[0-9A-Za-z_-]{22,}|EAA[A-Za-z0-9]{60,}"  # age, Square, Meta
    r"|xkeysib-[a-f0-9]{64}-[A-Za-z0-9]{16}|pplx-[A-Za-z0-9]{48}|fio-u-[A-Za-z0-9_=-]{64}"  # Brevo, ...
    r"|duffel_(?:test|live)_[A-Za-z0-9_=-]{43}|EZ[AT]K[A-Za-z0-9]{54}|FLW(?:SECK|PUBK)_TEST-[A-Za-z0-9]{12,}"
    r"|fo1_[A-Za-z0-9_-]{43}|fm[12][ar]?_[A-Za-z0-9+/]{100,}={0,3}|ATATT3[A-Za-z0-9_=-]{100,}"  # Fly.io, Atlassian
    r"|AKCp[A-Za-z0-9]{60,}|cmVmd[A-Za-z0-9]{59}|LTAI[A-Za-z0-9]{20}"  # Artifactory, Alibaba
    r"|ops_eyJ[A-Za-z0-9+/]{100,}={0,3}|A3-[A-Z0-9]{6}-[A-Z0-9-]{20,}"  # 1Password
    r"|[A-Za-z0-9_~.]{3}[0-9]Q~[A-Za-z0-9_~.-]{31,34}|sha256~[A-Za-z0-9_-]{43}"  # Azure AD, OpenShift
    r"|b3BlbnNzaC1rZXktdjE[A-Za-z0-9+/=]*"  # an OpenSSH private key's base64 body ("openssh-key-v1")
    r"|[0-9]{8,10}:[A-Za-z0-9_-]{35}(?![A-Za-z0-9_-])"  # Telegram bot token
    r"|[MNO][A-Za-z0-9_-]{23,25}\.[A-Za-z0-9_-]{6}\.[A-Za-z0-9_-]{27,}"  # Discord bot token
    r")"
)
# URLs, and the hosts of secret-bearing endpoints also written without a scheme.
_URL = _pattern(
    r"(?<![A-Za-z0-9+.\-])(?:[A-Za-z][A-Za-z0-9+.\-]*://|(?=(?:[\w-]+\.)*(?:hooks\.slack\.com|discord(?:app)?\.com"
    r"|api\.telegram\.org|webhook\.office\.com|maker\.ifttt\.com|hooks\.zapier\.com|events\.pagerduty\.com"
    r"|hc-ping\.com)/))[^\s'\"<>`]+"
)
# Path segments after which the rest of a URL's path is the secret (Mattermost, Rocket.Chat, Discord, Teams,
# Zapier, Feishu hooks, PagerDuty integrations), and those naming the next segment as one (IFTTT `/with/key/K`).
_HOOK_SEGMENTS = frozenset({"hook", "hooks", "webhook", "webhooks", "webhookb2", "incomingwebhook", "integration"})
_KEY_SEGMENTS = frozenset({"key", "keys", "token", "tokens", "apikey", "api_key", "api-key", "secret", "password"})
_WHOLE_PATH_HOSTS = ("hc-ping.com",)  # the whole path is the secret (healthchecks.io ping URLs)
_TELEGRAM_BOT = _pattern(r"bot[0-9]+:.+")
# Hex digests named as such (`sha256:...`, image digests) are content addresses, not secrets.
_HEX = _pattern(r"(?<![0-9a-fA-F])(?<!sha1:)(?<!sha224:)(?<!sha256:)(?<!sha384:)(?<!sha512:)(?<!md5:)[0-9a-fA-F]{32,}")
_GIT_WORD = _pattern(r"(?:^|[\s;&|(/])git\s")  # a shell string that runs git: its 40/64-hex words are object names
_GIT_OBJECT_LENGTHS = (40, 64)  # SHA-1 and SHA-256 object names
_GIT_BEFORE = frozenset(("", " ", "\t", "\n", ".", "="))  # what may stand before an object name: not a URL's `/`
_GIT_AFTER = frozenset(("", " ", "\t", "\n", ".", "^", "~", ":"))
_RUN = _pattern(r"(?<![A-Za-z0-9+/_\-])[A-Za-z0-9+/_\-]{20,}={0,2}")  # a candidate for `_looks_random`
_RUN_ENTROPY = 4.1  # bits per character: random base64 of 32 characters averages 4.5, words and paths 3.5-4.1
# `name=value` (query strings, `a=b,password=c`, libpq keyword strings) and `name: value` / `"name": "value"`.
_EQ_NAME = _pattern(r"(?<![A-Za-z0-9_.])(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)[ \t]*=(?!=)[ \t]*")
_COLON_NAME = _pattern(r"(?<![A-Za-z0-9_./])(?P<q>[\"']?)(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)(?P=q)[ \t]*:(?!//)[ \t]*")
_FINGERPRINTED = _pattern(r"key:[0-9a-f]{12}")
_FINGERPRINT_BEFORE = _pattern(r"(?:^|[\s=]|(?<![A-Za-z0-9])-[A-Za-z]*i)$")  # where `_fingerprint` puts one
_VALUE = _pattern(r"\"(?:[^\"\\]|\\.)*\"?|'[^']*'?|[^\s,;&'\"]+", re.S)

# ---- layer 2: words ---------------------------------------------------------------------------

# Shell words, and what separates them: white space and unquoted operators (`;`, `&&`, `|`, `>`, ...).
_WORD = _pattern(r"(?P<gap>\s+|[;&|<>()]+)|(?:[^\s'\"\\;&|<>()]|\\.?|'[^']*'?|\"(?:[^\"\\]|\\.)*\"?)+", re.S)
_PAIR = _pattern(r"(?P<dash>-{0,2})(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)=(?P<value>.*)", re.S)
_OPTION = _pattern(r"(?P<dash>-{1,2})(?P<name>[A-Za-z0-9][A-Za-z0-9_.\-]*)")
_SHORT = _pattern(r"-(?P<letter>[A-Za-z0-9])(?P<rest>.*)", re.S)
_HEADER = _pattern(r"\s*(?:-H\s*)?(?P<name>[A-Za-z][A-Za-z0-9_\-]*)[ \t]*:(?!//)[ \t]*(?P<value>.*)", re.S)
_IDENTITY_TEXT = _pattern(r"\s*IdentityFile(?:\s*=\s*|\s+)(?P<value>.*)", re.S | re.I)
_IDENTIFIER = _pattern(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_OPTION_LIKE = _pattern(r"--[A-Za-z][A-Za-z0-9\-]*(?:=.*)?|-[A-Za-z]", re.S)  # not taken as an option's value
_SHELL_C = _pattern(r"-[A-Za-z]*c[A-Za-z]*")  # sh -c, bash -lc: the next argument is a command string
_ORACLE_LOGIN = _pattern(r"(?P<head>(?:userid=)?[A-Za-z_][\w$#]*/)(?P<password>[^/@\s]+)(?P<database>@\S*)?", re.I)
_FREERDP_SECRET = _pattern(r"(?i)(?<=[/,])(p|pth|gp|password|gateway-password):[^,]*")  # /p:X, /gateway:...,p:X
_HTPASSWD_BATCH = _pattern(r"-[A-Za-z]*b[A-Za-z]*")
_ASSIGNMENT = _pattern(r"[A-Za-z_][A-Za-z0-9_]*=.*", re.S)
_SPACE = _pattern(r"\s")
_QUOTED = _pattern(r"'[^']*'|\"(?:[^\"\\]|\\.)*\"", re.S)
# `-i` outside ssh (plink, knife ...): a value named like a key file; ansible's `-i inventory/prod.ini` stays.
_KEY_PATH = _pattern(r".*(?:\.ssh/|(?:^|/)id_[^/]*$|key[^/]*$|\.(?:pem|ppk|p12|pfx)$)", re.S | re.I)


class _State:
    """What scrubbing one command line has learnt so far."""

    def __init__(self, extra: tuple[re.Pattern[str], ...]) -> None:
        self.extra = extra
        self.program = ""  # context from the last known program word (`ssh`, `curl`, `login`, ...)
        self.pending = ""  # action for the next word: the previous one was a secret option expecting a value
        self.previous = ""  # previous word, lower-cased (for `set NAME VALUE`)
        self.shell_next = False  # the next argument is a shell command string (after `sh -c`)
        self.redact_rest = False  # `htpasswd -b`: the password is positional, so everything after goes

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


_PLAIN_PATH = _pattern(r"[\w./+-]{1,256}")  # a bare path: no shell words, no `NAME=`, no user info


def executable_name(program: object) -> str:
    """Basename of the executable (str, bytes, os.PathLike, or a shell command string -> first word's basename).

    Never raises: odd input (None, ints, non-UTF-8 bytes, empty) gives a safe string like "?"; bytes are
    decoded with errors="backslashreplace"; the result is at most `MAX_NAME_CHARS` characters. A shell
    command's leading `NAME=value` words are skipped, so `PGPASSWORD=x psql -h db` gives "psql". A string
    with white space is read as a shell command, so an executable path containing spaces gives its first word.
    """
    if type(program) is str:
        name = _NAMES_OF_PATHS.get(program)
        if name is not None:
            return name
    try:
        if type(program) is str and _PLAIN_PATH.fullmatch(program):  # the usual case, the same few paths
            name = _executable_name(program)
            if len(_NAMES_OF_PATHS) < _NAMES_OF_PATHS_MAX:
                _NAMES_OF_PATHS[program] = name
            return name
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


# Bare paths only (`_PLAIN_PATH`): a shell command line may hold secrets, which no cache keeps. The first
# paths seen stay: a server spawns the same few programs, each looked up with one dict read.
_NAMES_OF_PATHS: dict[str, str] = {}
_NAMES_OF_PATHS_MAX = 256


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


def scrub_value(value: str) -> str:
    """A string stallwatch recorded from the host, checked once more as it leaves the process (an attribute
    value, a log body, a journal field, a freeze report): secrets replaced as in one command-line argument,
    whatever wrapper recorded it and whether or not that wrapper scrubbed it. Idempotent on scrubbed text (an
    identity file's `key:` fingerprint included). Unbounded: callers keep their own limits. Returns `value`
    itself when nothing changed (the common case, remembered for repeated values). Never raises: "[REDACTED]"
    if checking fails."""
    try:
        if (len(value) < _SHORTEST_SECRET and not _SEPARATES.search(value)) or value in _clean_values:
            return value
        # Short plain words, none a secret's name (`name (N args)`, statuses): no rule can fire.
        plain = _PLAIN_WORDS.fullmatch(value) and not _LONG_WORD.search(value) and not _TRIGGERS.search(value.lower())
        if not plain:
            state = _State(())
            scrubbed = _text(_inline(value, state), state, 0)  # words: a recorded shell line stays one
            if scrubbed != value:
                return scrubbed
        if len(_clean_values) >= _CLEAN_VALUES_LIMIT:
            _clean_values.clear()
        _clean_values[value] = None  # clean: it leaves the process anyway, so keeping it here costs nothing
        return value
    except Exception:
        return REDACTED


def scrub_attributes(attributes: Mapping[str, object]) -> Mapping[str, object]:
    """`attributes` with each string value passed through `scrub_value` and each sequence of strings through
    `scrub_args` (read as the argv it usually is, so a git object name stays one), but for the server-given ids
    `telemetry.IDENTIFIERS` names; `attributes` itself when nothing changed."""
    changed: dict[str, object] | None = None
    clean, identifiers = _clean_values, telemetry.IDENTIFIERS
    value: Any  # told apart by exact type below (a subclass is left as it is), which mypy does not follow
    for key, value in attributes.items():
        kind = type(value)
        if kind is str:
            if value in clean or key in identifiers:
                continue
            checked: object = scrub_value(value)
        elif (kind is list or kind is tuple) and value and all(type(item) is str for item in value):
            listed = tuple(value)
            if key in identifiers or listed in _clean_lists:
                continue
            items = scrub_args(value)
            checked = value if items == list(value) else kind(items)
            if checked is value:
                if len(_clean_lists) >= _CLEAN_VALUES_LIMIT:
                    _clean_lists.clear()
                _clean_lists[listed] = None
        else:
            continue
        if checked is not value:
            if changed is None:
                changed = dict(attributes)
            changed[key] = checked
    return attributes if changed is None else changed


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
    if "/" in text:
        text = _URL.sub(_url, text)
    text = _HEX.sub(lambda match: _hex_blob(match, state), text)
    text = _RUN.sub(_random_run, text)
    text = _named_values(text, _EQ_NAME, state)
    return _named_values(text, _COLON_NAME, state)


def _url(match: re.Match[str]) -> str:
    """A URL with the secret parts of its path redacted: what follows a hook segment, the segment after a
    `key`/`token` segment, a Telegram `bot<token>`, and any random-looking segment."""
    url = match.group()
    scheme = url.find("://")
    start = scheme + 3 if scheme >= 0 else 0
    slash = url.find("/", start)
    if slash < 0:
        return url
    end = min((i for i in (url.find("?", slash), url.find("#", slash)) if i >= 0), default=len(url))
    host = url[start:slash].rpartition("@")[2].lower()
    path = url[slash + 1 : end]
    if host.endswith(_WHOLE_PATH_HOSTS) and path:
        return url[: slash + 1] + REDACTED + url[end:]
    segments = path.split("/")
    if host == "hooks.slack.com" and len(segments) > 1:  # /services/T.../B.../secret, /workflows/..., /triggers/...
        segments = [segments[0], REDACTED]
    kept: list[str] = []
    for segment in segments:
        previous = kept[-1].lower() if kept else ""
        if previous in _HOOK_SEGMENTS and segment:
            kept.append(REDACTED)  # the rest of the path
            break
        if _TELEGRAM_BOT.fullmatch(segment):
            segment = "bot" + REDACTED
        elif (previous in _KEY_SEGMENTS and _value_like(segment)) or (
            len(segment) >= 20 and _looks_random(segment.rstrip("="))
        ):
            segment = REDACTED
        kept.append(segment)
    return url[: slash + 1] + "/".join(kept) + url[end:]


def _value_like(segment: str) -> bool:
    """A URL path segment that reads as a value rather than a word: a digit or a capital in it, or long."""
    return len(segment) >= 16 or any(c.isdigit() or c.isupper() for c in segment)


def _hex_blob(match: re.Match[str], state: _State) -> str:
    run = match.group()
    if not (any(c.isdigit() for c in run) and any(c.isalpha() for c in run)):
        return run
    text, start, end = match.string, match.start(), match.end()
    whole_word = text[start - 1 : start] in _GIT_BEFORE and text[end : end + 1] in _GIT_AFTER
    if (
        len(run) in _GIT_OBJECT_LENGTHS
        and whole_word
        and (state.program == "git" or _GIT_WORD.search(text, 0, start) is not None)
    ):
        return run  # a commit or object name given to git (`git checkout SHA`, `SHA..SHA`, `SHA^`)
    return REDACTED


def _random_run(match: re.Match[str]) -> str:
    """A run of base64/base64url characters, redacted if it looks random. An absolute path, or the path of a
    URL or file name (the run follows a dot), is judged segment by segment first, so that only a random segment
    goes and the words around it stay readable."""
    run = match.group()
    start = match.start()
    if "/" in run and (run.startswith("/") or (start and match.string[start - 1] == ".")):
        segments = run.split("/")
        scrubbed = [REDACTED if len(s) >= 20 and _looks_random(s.rstrip("=")) else s for s in segments]
        if scrubbed != segments:
            return "/".join(scrubbed)
    return REDACTED if _looks_random(run.rstrip("=")) else run  # a path of words stays; base64 with `/` does not


# How likely each character class follows another in text people write on command lines, against a random
# base64url string. Classes: 0 lower-case vowel, 1 other lower-case letter, 2 upper-case vowel, 3 other upper-case
# letter, 4 digit, 5 `+/_-`. `_FOLLOWS[a][b]`: how often class b follows class a in 1.9 million file names, package
# names and command lines of a Debian system (paths, identifiers, man pages, CMake and Python modules).
_FOLLOWS = (
    (0.112, 0.805, 0.001, 0.003, 0.005, 0.074),
    (0.480, 0.394, 0.001, 0.003, 0.009, 0.113),
    (0.034, 0.340, 0.065, 0.494, 0.005, 0.062),
    (0.379, 0.148, 0.172, 0.210, 0.011, 0.080),
    (0.019, 0.097, 0.001, 0.004, 0.626, 0.253),
    (0.202, 0.735, 0.009, 0.028, 0.019, 0.008),
)
_RANDOM_CLASS = (5 / 64, 21 / 64, 5 / 64, 21 / 64, 10 / 64, 2 / 64)  # each class's share of the base64url alphabet
_CLASS_OF = str.maketrans(
    {
        **dict.fromkeys("aeiou", "0"),
        **dict.fromkeys("bcdfghjklmnpqrstvwxyz", "1"),
        **dict.fromkeys("AEIOU", "2"),
        **dict.fromkeys("BCDFGHJKLMNPQRSTVWXYZ", "3"),
        **dict.fromkeys("0123456789", "4"),
        **dict.fromkeys("+/_-", "5"),
    }
)
# log(random / written) for each pair of classes, by the pair's two class digits; pairs across a separator are
# left out, so a path's words are judged as words.
_PAIR_SCORE = {f"{a}{b}": math.log(_RANDOM_CLASS[b] / _FOLLOWS[a][b]) for a in range(5) for b in range(5)}
_RANDOM_SCORE = 0.3  # mean score per pair from which a run is random (docs/scrubbing.md: what it misses)


def _looks_random(core: str) -> bool:
    """Whether a run of base64/base64url characters (20 or more, padding removed) looks like a random token
    rather than words: it mixes upper and lower case, and its character classes follow each other as in random
    text more than as in words (a likelihood ratio per pair of neighbours, `_PAIR_SCORE`), or it is a long
    high-entropy run."""
    if core.islower() or core.isupper() or len(core) < 20 or _reads_as_words(core):
        return False
    classes = core.translate(_CLASS_OF)
    scores = [score for score in map(_PAIR_SCORE.get, map(operator.add, classes, classes[1:])) if score is not None]
    mean = sum(scores) / len(scores) if scores else 0.0
    if mean >= _RANDOM_SCORE:
        return True
    long_and_dense = len(core) >= 32 and "/" not in core and any(c.isdigit() for c in core)
    return long_and_dense and mean >= -_RANDOM_SCORE and _entropy(core) >= _RUN_ENTROPY


_WORD_PART = _pattern(r"[A-Z][a-z]+|[a-z]+|[0-9]{1,2}|[_-]")
_VOWEL = _pattern(r"[aeiouyAEIOUY]")


def _reads_as_words(core: str) -> bool:
    """Whether `core` is an identifier made of words (`PyThreadState_SetAsyncExc`, `ThreadPoolExecutor`):
    two or more capitalised or lower-case parts, each with a vowel, and short numbers. Random base64 reads
    so about once in 10,000 at 20 characters and almost never from 32 (docs/scrubbing.md)."""
    position = words = 0
    for part in _WORD_PART.finditer(core):
        if part.start() != position:
            return False
        if part.group()[0].isalpha():
            if not _VOWEL.search(part.group()):
                return False
            words += 1
        position = part.end()
    return position == len(core) and words >= 2


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
        if value is None or text.startswith(REDACTED, match.end()):
            continue  # nothing, or scrubbed text checked once more
        if _FINGERPRINTED.fullmatch(text, match.end("name") - 3, value.end()) and _FINGERPRINT_BEFORE.search(
            text, 0, match.end("name") - 3
        ):
            continue  # an identity file's `key:` fingerprint: `-ikey:…`, `IdentityFile=key:…`
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
    if header and state.kind(header["name"]) == _SECRET and not _FINGERPRINTED.fullmatch(text.strip()):
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
    special = _program_word(plain, state)
    if special is not None:
        return special
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
    if header and state.kind(header["name"]) == _SECRET and not _FINGERPRINTED.fullmatch(plain):
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


def _program_word(plain: str, state: _State) -> str | None:
    """Words only some programs take as credentials: sqlplus's `user/password@db`, xfreerdp's `/p:password`,
    nmcli's `password VALUE`; None if not one."""
    if state.program == "oracle":
        login = _ORACLE_LOGIN.fullmatch(plain)
        return login["head"] + REDACTED + (login["database"] or "") if login else None
    if state.program == "freerdp" and plain.startswith("/"):
        scrubbed = _FREERDP_SECRET.sub(lambda match: match[1] + ":" + REDACTED, plain)
        return scrubbed if scrubbed != plain else None
    if state.program == "nmcli" and _IDENTIFIER.fullmatch(plain) and state.kind(plain) == _SECRET:
        state.pending = _SECRET  # nmcli dev wifi connect SSID password VALUE, ... wifi-sec.psk VALUE
        return plain
    return None


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
        return "-i" + _fingerprint(rest) if _KEY_PATH.match(rest) else None
    options = _SHORT_OPTIONS.get(state.program, {})
    name = plain[1:3] if plain[1:3] in options else letter
    action, separate = options.get(name, ("", False))
    if not action:
        return None
    rest = plain[1 + len(name) :]
    if rest:
        return "-" + name + _apply(action, rest)
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
    if action == _MAYBE_IDENTITY and not _KEY_PATH.match(value):
        return None
    if action.startswith("user") and action[-1] not in value:
        return None
    return _apply(action, value)


def _apply(action: str, value: str) -> str:
    if action in (_IDENTITY, _MAYBE_IDENTITY):
        return _fingerprint(value)
    if action.startswith("user"):
        user, separator, rest = value.partition(action[-1])
        if not separator:
            return value
        database = rest.rpartition("@")[1:] if action == _USER_SLASH else ("", "")
        return user + separator + REDACTED + "".join(database)
    return REDACTED if value else value


def _fingerprint(path: str) -> str:
    """`key:` and 12 hex digits of the SHA-256 of the file name: the same key is recognisable, its path is not."""
    path = path.strip().strip("'\"").rstrip("/")
    if _FINGERPRINTED.fullmatch(path):
        return path  # scrubbed text checked once more
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
