"""Hypothesis strategies for secrets nobody listed: random tokens, and command lines that carry them anywhere.

A token's characters come from a generator seeded by hypothesis, not from hypothesis itself: hypothesis
decides where the token goes and how it is encoded, while its bytes stay random, as a real token's are (a
shrunk token of zeros would be a word, not a secret). Tokens carry at least 32 random bytes, or follow a
documented token layout (`SHAPES`) with a random body.
"""

from __future__ import annotations

import base64
import random
import shlex
import string

from hypothesis import strategies as st

_B62 = string.ascii_letters + string.digits
_B64URL = _B62 + "-_"
_HEX = "0123456789abcdef"


def _base62(data: bytes) -> str:
    number, digits = int.from_bytes(data, "big"), []
    while number:
        number, digit = divmod(number, 62)
        digits.append(_B62[digit])
    return "".join(digits) or "0"


ENCODINGS = {
    "hex": lambda data: data.hex(),
    "base64": lambda data: base64.b64encode(data).decode(),
    "base64url": lambda data: base64.urlsafe_b64encode(data).decode().rstrip("="),
    "base62": _base62,
}
# Documented layouts (gitleaks, detect-secrets): prefix, alphabet and length of the random body.
SHAPES = (
    ("ghp_", _B62, 36),
    ("github_pat_", _B62 + "_", 82),
    ("glpat-", _B64URL, 20),
    ("xoxb-123456789012-123456789012-", _B62, 24),
    ("sk_live_", _B62, 24),
    ("sk-proj-", _B64URL, 48),
    ("AIza", _B64URL, 35),
    ("npm_", _B62, 36),
    ("hvs.", _B64URL, 90),
    ("hf_", string.ascii_letters, 34),
    ("dapi", _HEX, 32),
    ("shpat_", _HEX, 32),
    ("AKIA", string.ascii_uppercase + string.digits, 16),
    ("SK", _HEX, 32),
    ("glsa_", _B62, 32),
)
NEUTRAL_OPTIONS = ("--value", "--data", "--input", "--target", "--arg", "--ref", "--payload", "--id")
WORDS = (
    "deploy", "run", "--verbose", "-n", "prod", "eu-west-1", "/srv/app", "app.main:app", "8080:80", "--port",
    "8000", "build/", "origin", "main", "-q", "tests/test_api.py", "db.example.com", "10.0.0.5", "--dry-run",
)  # fmt: skip


@st.composite
def random_tokens(draw: st.DrawFn, *, url_safe: bool = False) -> str:
    """A token of 32-48 random bytes in one of `ENCODINGS` (base64 left out when `url_safe`), or a `SHAPES` layout."""
    generator = random.Random(draw(st.integers(0, 2**64)))
    if draw(st.booleans()):
        prefix, alphabet, size = draw(st.sampled_from(SHAPES))
        return prefix + "".join(generator.choice(alphabet) for _ in range(size))
    encodings = sorted(ENCODINGS) if not url_safe else ["base62", "base64url", "hex"]
    encoding = draw(st.sampled_from(encodings))
    return ENCODINGS[encoding](generator.randbytes(draw(st.integers(32, 48))))


@st.composite
def carried(draw: st.DrawFn) -> tuple[list[str], str]:
    """A few words carrying a random token in one of the ways command lines carry values; (words, token)."""
    form = draw(st.sampled_from(["bare", "eq", "sep", "glued", "env", "url-path", "url-query", "json", "userinfo",
                                 "bearer"]))  # fmt: skip
    token = draw(random_tokens(url_safe=form.startswith("url")))
    option = draw(st.sampled_from(NEUTRAL_OPTIONS))
    words = {
        "bare": [token],
        "eq": [f"{option}={token}"],
        "sep": [option, token],
        "glued": [f"-x{token}"],
        "env": [f"JOB_VALUE={token}"],
        "url-path": [f"https://files.example.com/v1/{token}/report.csv"],
        "url-query": [f"https://api.example.com/items?after={token}&limit=10"],
        "json": [f'{{"ref": "{token}", "n": 1}}'],
        "userinfo": [f"https://ci:{token}@git.example.com/org/repo.git"],
        "bearer": ["-H", f"Authorization: Bearer {token}"],
    }[form]
    return words, token


@st.composite
def command_lines(draw: st.DrawFn) -> tuple[list[str], str, str]:
    """An argv and a shell string (the same words, quoted) carrying a random token at an arbitrary position:
    (argv, shell string, token)."""
    # Not git: a 40 or 64 hex word given to git is kept as an object name, by design (docs/scrubbing.md).
    program = draw(st.sampled_from(["app", "/usr/local/bin/tool", "curl", "python3", "docker", "kubectl", "make"]))
    before = draw(st.lists(st.sampled_from(WORDS), max_size=6))
    after = draw(st.lists(st.sampled_from(WORDS), max_size=6))
    words, token = draw(carried())
    argv = [program, *before, *words, *after]
    return argv, shlex.join(argv), token
