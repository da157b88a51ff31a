"""The command-line scrubber: a corpus of real-looking command lines with seeded secrets must leak none
of them while keeping the harmless parts, and no input at all may make it raise or exceed its bounds."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stallwatch.instrument.scrub import (
    MAX_ARG_CHARS,
    MAX_ARGS,
    MAX_NAME_CHARS,
    REDACTED,
    UNSCRUBBABLE,
    compile_patterns,
    executable_name,
    scrub_args,
)

JWT = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiJqd3QtY29ycHVzLTQ0MDQifQ.JwtSig4404_q8Zt1xWm2VbN"
DIGEST = "sha256:0d2c5fbb3a4e6f7a8b9c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0e1f2a"


def fingerprint(name: str) -> str:
    return "key:" + hashlib.sha256(name.encode()).hexdigest()[:12]


# (argv, seeded secrets (none may survive), harmless parts (all must survive))
CORPUS: list[tuple[list[object], tuple[str, ...], tuple[str, ...]]] = [
    (
        ["ssh", "-i", "/home/deploy-7f3a/.ssh/id_prod_9x2", "-N", "-L", "5432:db:5432", "bastion.example.com"],
        ("deploy-7f3a", "id_prod_9x2"),
        ("ssh", "-N", "5432:db:5432", "bastion.example.com", fingerprint("id_prod_9x2")),
    ),
    (
        [
            "ssh",
            "-o",
            "IdentityFile=/srv/keys-alpha/alpha_key",
            "-oIdentityFile=/srv/keys-beta/beta_key",
            "-o",
            "IdentityFile /srv/keys-gamma/gamma_key",
            "-o",
            "StrictHostKeyChecking=no",
            "worker-1.internal",
        ],
        ("keys-alpha", "alpha_key", "keys-beta", "beta_key", "keys-gamma", "gamma_key"),
        ("StrictHostKeyChecking=no", "worker-1.internal", "IdentityFile=", fingerprint("beta_key")),
    ),
    (["ssh", "ssh://ops:SshPw-4471@jump.example.net:2222"], ("SshPw-4471",), ("jump.example.net:2222",)),
    (
        ["scp", "-i/opt/ci-runner/keys/ci_ed25519", "build.tar", "deploy@files.example.com:/srv/"],
        ("ci-runner", "ci_ed25519"),
        ("scp", "build.tar", "deploy@files.example.com:/srv/"),
    ),
    (
        ["ssh", "-NTi", "/root/tunnel-dir-33/tunnel_key_33", "-p", "2200", "gw.example.com"],
        ("tunnel-dir-33", "tunnel_key_33"),
        ("-NTi", "2200", "gw.example.com"),
    ),
    (
        ["curl", "-sS", "-H", "Authorization: Bearer tokBearer-5512", "https://api.example.com/v2/items"],
        ("tokBearer-5512",),
        ("curl", "-sS", "Authorization:", "https://api.example.com/v2/items"),
    ),
    (
        ["curl", "-u", "admin:CurlPw-8830", "https://registry.example.com/v2/_catalog"],
        ("CurlPw-8830",),
        ("admin:", "https://registry.example.com/v2/_catalog"),
    ),
    (
        [
            "curl",
            "-H",
            "X-Api-Key: apikey-7781-zz",
            "-H",
            "Cookie: sessionid=cookie-6620",
            "-b",
            "sid=cookiejar-9911",
            "https://shop.example.com/cart",
        ],
        ("apikey-7781-zz", "cookie-6620", "cookiejar-9911"),
        ("X-Api-Key:", "Cookie:", "-b", "https://shop.example.com/cart"),
    ),
    (
        ["psql", "postgresql://app_user:PgPw-1902@db.example.com:5432/appdb?sslmode=require"],
        ("PgPw-1902", "app_user"),
        ("psql", "db.example.com:5432/appdb?sslmode=require"),
    ),
    (
        ["env", "PGPASSWORD=EnvPgPw-3391", "psql", "-h", "db.example.com", "-U", "app"],
        ("EnvPgPw-3391",),
        ("env", "PGPASSWORD=", "psql", "db.example.com"),
    ),
    (
        ["env", "PGPASSWORD=correct horse 3391 staple", "psql"],
        ("correct", "horse 3391", "staple"),
        ("env", "PGPASSWORD=", "psql"),
    ),
    (
        ["PGPASSWORD=ShellPgPw-2277 psql -h db.example.com -c 'select 1'"],
        ("ShellPgPw-2277",),
        ("PGPASSWORD=", "psql -h db.example.com", "'select 1'"),
    ),
    (
        [
            "docker",
            "run",
            "--rm",
            "-e",
            "AWS_SECRET_ACCESS_KEY=DockerAwsSecret-6601",
            "-e",
            "AWS_REGION=eu-west-1",
            "amazon/aws-cli",
            "s3",
            "ls",
        ],
        ("DockerAwsSecret-6601",),
        ("AWS_SECRET_ACCESS_KEY=", "AWS_REGION=eu-west-1", "amazon/aws-cli", "s3"),
    ),
    (
        ["aws", "configure", "set", "aws_secret_access_key", "AwsConfigureSecret-7104"],
        ("AwsConfigureSecret-7104",),
        ("configure", "aws_secret_access_key"),
    ),
    (
        ["aws", "sts", "get-caller-identity", "--secret-access-key", "AwsFlagSecret-5150", "--region", "us-east-1"],
        ("AwsFlagSecret-5150",),
        ("get-caller-identity", "--secret-access-key", "us-east-1"),
    ),
    (
        ["git", "clone", "https://oauth2:GitToken-4481@gitlab.example.com/group/repo.git"],
        ("GitToken-4481",),
        ("clone", "gitlab.example.com/group/repo.git"),
    ),
    (
        ["kubectl", "--token=KubeToken-3007", "--server=https://k8s.example.com:6443", "get", "pods", "-n", "prod"],
        ("KubeToken-3007",),
        ("--token=", "--server=https://k8s.example.com:6443", "get", "pods", "prod"),
    ),
    (
        ["mysql", "--password=MysqlPw-8192", "-h", "mysql.example.com", "shop"],
        ("MysqlPw-8192",),
        ("mysql.example.com", "shop"),
    ),
    (["mysql", "-uroot", "-pMysqlGlued-6464", "shop"], ("MysqlGlued-6464",), ("-uroot", "shop")),
    (
        [
            "helm",
            "upgrade",
            "api",
            "./chart",
            "--set",
            "secret.value=HelmSecret-3311",
            "--set",
            "replicas=3,db.password=HelmDbPw-7712",
        ],
        ("HelmSecret-3311", "HelmDbPw-7712"),
        ("./chart", "replicas=3", "db.password="),
    ),
    (
        ["gcloud", "--access-token-file=/home/gc-user-4410/token.txt", "compute", "instances", "list"],
        ("gc-user-4410",),
        ("--access-token-file=", "compute", "instances"),
    ),
    (
        [
            "openssl",
            "pkcs12",
            "-export",
            "-passin",
            "pass:OpensslIn-5823",
            "-passout",
            "pass:OpensslOut-5824",
            "-in",
            "cert.pem",
        ],
        ("OpensslIn-5823", "OpensslOut-5824"),
        ("-export", "-passin", "cert.pem"),
    ),
    (["vault", "login", "token=VaultToken-9931"], ("VaultToken-9931",), ("vault", "login", "token=")),
    (
        ["vault", "login", "hvs.CAESIVaultShape0123456789abcdefghijkl"],
        ("VaultShape0123456789",),
        ("vault", "login"),
    ),
    (
        [
            "rsync",
            "-az",
            "-e",
            "ssh -i /home/backup-8123/.ssh/backup_key -p 2222",
            "data/",
            "backup@store.example.com:/srv/",
        ],
        ("backup-8123", "backup_key"),
        ("-az", "ssh -i key:", "-p 2222", "data/", "backup@store.example.com:/srv/"),
    ),
    (
        ["docker", "login", "-u", "ci-bot", "-p", "DockerLoginPw-4040", "registry.example.com"],
        ("DockerLoginPw-4040",),
        ("ci-bot", "registry.example.com"),
    ),
    (
        ["sshpass", "-p", "SshpassPw-7070", "ssh", "-o", "StrictHostKeyChecking=no", "admin@10.0.0.5"],
        ("SshpassPw-7070",),
        ("sshpass", "StrictHostKeyChecking=no", "admin@10.0.0.5"),
    ),
    (
        ["curl -fsS -H 'Authorization: token GhShellToken-1357' https://api.github.com/user"],
        ("GhShellToken-1357",),
        ("curl -fsS -H", "https://api.github.com/user"),
    ),
    (
        ["sh", "-c", "export API_TOKEN=ExportToken-2468; mysql --password 'Mysql Spaced 8642' -h db.example.com"],
        ("ExportToken-2468", "Spaced", "8642"),
        ("sh", "export API_TOKEN=", "mysql --password", "-h db.example.com"),
    ),
    (
        [b"/usr/bin/curl", b"--oauth2-bearer", b"BytesBearer-\xff-5151", b"https://api.example.com"],
        ("BytesBearer", "5151"),
        ("/usr/bin/curl", "--oauth2-bearer", "https://api.example.com"),
    ),
    (
        [Path("/usr/bin/ssh"), "-i", Path("/home/pathlike-6262/.ssh/id_path_6262"), PurePosixPath("host.example.com")],
        ("pathlike-6262", "id_path_6262"),
        ("/usr/bin/ssh", "host.example.com", fingerprint("id_path_6262")),
    ),
    (
        ["curl", "https://storage.example.com/b/o?token=QueryToken-7331&sig=QuerySig-7332&page=2"],
        ("QueryToken-7331", "QuerySig-7332"),
        ("https://storage.example.com/b/o?token=", "&page=2"),
    ),
    (
        [
            "curl",
            "https://bucket.s3.amazonaws.com/o?X-Amz-Credential=AKIAQSTUVWXYZ2345678%2F20240101"
            "&X-Amz-Signature=S3Signature-8080&X-Amz-Expires=300",
        ],
        ("AKIAQSTUVWXYZ2345678", "S3Signature-8080"),
        ("bucket.s3.amazonaws.com", "X-Amz-Expires=300"),
    ),
    (["python", "client.py", JWT], (JWT, "JwtSig4404"), ("python", "client.py")),
    (
        ["terraform", "apply", "-var", "access_id=AKIAIOSFODNN7CORPUS1"],
        ("AKIAIOSFODNN7CORPUS1",),
        ("-var", "access_id="),
    ),
    (
        ["deploy.sh", "production", "ghp_Corpus0123456789abcdefghijABCDEF"],
        ("ghp_Corpus0123456789abcdefghijABCDEF", "Corpus0123456789"),
        ("deploy.sh", "production"),
    ),
    (
        ["datadog-agent", "check", "disk", "3f2a9c0b7e1d4f6a8b5c2e9d1a7f3b6c"],
        ("3f2a9c0b7e1d4f6a8b5c2e9d1a7f3b6c",),
        ("check", "disk"),
    ),
    (
        [
            "mc",
            "alias",
            "set",
            "minio",
            "https://minio.example.com",
            "minioadmin",
            "wJalrXUtnFEMI/K7MDENG/bPxRfiCY9CorpusKEY",
        ],
        ("wJalrXUtnFEMI", "bPxRfiCY9CorpusKEY"),
        ("alias", "minio", "https://minio.example.com", "minioadmin"),
    ),
    (
        ["git", "-c", "http.extraHeader=Authorization: Basic Z2l0OkJhc2ljLTk5MDE=", "fetch", "origin"],
        ("Z2l0OkJhc2ljLTk5MDE",),
        ("http.extraHeader=Authorization:", "fetch", "origin"),
    ),
    (
        ["redis-cli", "-h", "cache.example.com", "-a", "RedisPw-1188", "PING"],
        ("RedisPw-1188",),
        ("cache.example.com", "-a", "PING"),
    ),
    (
        ["mongosh", "mongodb+srv://svc:MongoPw-2299@cluster0.example.net/prod"],
        ("MongoPw-2299",),
        ("mongodb+srv://", "cluster0.example.net/prod"),
    ),
    (
        [
            "age",
            "-e",
            "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktPEMCORPUS\n-----END OPENSSH PRIVATE KEY-----",
        ],
        ("PEMCORPUS",),
        ("age", "-e"),
    ),
    (
        ["java", "-Djavax.net.ssl.keyStorePassword=JavaKsPw-3434", "-Xmx2g", "-jar", "app.jar"],
        ("JavaKsPw-3434",),
        ("-Xmx2g", "app.jar"),
    ),
    (
        ["kubectl", "create", "secret", "generic", "db", "--from-literal=password=KubeLiteral-5656"],
        ("KubeLiteral-5656",),
        ("kubectl", "create", "--from-literal=password="),
    ),
    (
        ["psql", "host=db.example.com user=app password=LibpqPw-7878 dbname=app"],
        ("LibpqPw-7878",),
        ("host=db.example.com", "dbname=app"),
    ),
    (
        ["ansible-playbook", "site.yml", "--extra-vars", '{"db_password": "JsonPw-9090", "env": "prod"}'],
        ("JsonPw-9090",),
        ("site.yml", '"env": "prod"'),
    ),
    (
        ["htpasswd", "-b", "/etc/nginx/.htpasswd", "alice", "HtpasswdPw-1212"],
        ("HtpasswdPw-1212",),
        ("htpasswd", "-b"),
    ),
    (
        ["rsync", "backup:RsyncPw-3131@nas.example.com::share", "/tmp/restore"],
        ("RsyncPw-3131",),
        ("nas.example.com::share", "/tmp/restore"),
    ),
    (
        ["GIT_SSH_COMMAND='ssh -i /home/gitops-4242/.ssh/gitops_key' git fetch origin"],
        ("gitops-4242", "gitops_key"),
        ("GIT_SSH_COMMAND=", "git fetch origin"),
    ),
    (
        ["wget", "--user=ftpuser", "--password=WgetPw-6565", "ftp://ftp.example.com/file"],
        ("WgetPw-6565",),
        ("--user=ftpuser", "ftp://ftp.example.com/file"),
    ),
    (
        [
            "az",
            "login",
            "--service-principal",
            "-u",
            "http://app",
            "-p",
            "AzSpSecret-8787",
            "--tenant",
            "contoso.example",
        ],
        ("AzSpSecret-8787",),
        ("--service-principal", "http://app", "contoso.example"),
    ),
    (
        ["terraform", "apply", "-var", "db_password=TfPw-2020", "-auto-approve"],
        ("TfPw-2020",),
        ("-var", "db_password=", "-auto-approve"),
    ),
    (
        ["sudo", "-u", "postgres", "psql", "-c", "ALTER USER app WITH PASSWORD 'SqlPw-4646'"],
        ("SqlPw-4646",),
        ("postgres", "ALTER USER app WITH PASSWORD"),
    ),
    (["python3", "-c", "import os; password = 'PyPw-5757'; print(1)"], ("PyPw-5757",), ("import os;", "print(1)")),
    (
        ["curl", "-d", "user=alice&password=FormPw-6868", "-d", '{"token":"JsonTok-6869"}', "https://auth.example.com"],
        ("FormPw-6868", "JsonTok-6869"),
        ("user=alice", "https://auth.example.com"),
    ),
    (
        ["ssh", "-o", "ProxyCommand=ssh -i /home/proxy-9797/k_proxy -W %h:%p bastion", "db.internal"],
        ("proxy-9797", "k_proxy"),
        ("ProxyCommand=ssh -i key:", "-W %h:%p bastion", "db.internal"),
    ),
    (["grep", "-i", "password=GrepPw-1414", "/etc/app.conf"], ("GrepPw-1414",), ("grep", "-i", "/etc/app.conf")),
    (["env", "-i", "TOKEN=EnvITok-2525", "cmd"], ("EnvITok-2525",), ("env", "-i", "cmd")),
    (
        ["npm", "publish", "--//registry.npmjs.org/:_authToken=NpmAuth-3535"],
        ("NpmAuth-3535",),
        ("publish", "registry.npmjs.org"),
    ),
]

# Command lines without secrets: recorded unchanged.
HARMLESS: list[list[str]] = [
    ["ssh", "-N", "-o", "ServerAliveInterval=30", "-o", "StrictHostKeyChecking=accept-new", "ops@bastion.example.com"],
    ["docker", "pull", f"nginx:1.25@{DIGEST}"],
    ["git", "log", "--author=alice", "--oneline", "-n", "5"],
    ["kubectl", "get", "pods", "-o", "wide", "--kubeconfig", "/etc/kube/config", "-n", "kube-system"],
    ["grep", "-i", "error", "/var/log/syslog"],
    ["wget", "--keep-session-cookies", "https://example.com/"],
    ["docker", "login", "--username", "ci", "--password-stdin", "ghcr.io"],
    ["python3", "-m", "pip", "install", "requests==2.31.0"],
    ["az", "account", "set", "--subscription", "3fa85f64-5717-4562-b3fc-2c963f66afa6"],
    ["/nix/store/0c9kxxx1h3kzrf0k7vf8qn5y6hq8z0vx-python3-3.11.4/bin/python3", "-c", "print(1)"],
    ["rsync", "-az", "--delete", "src/", "backup@store.example.com:/srv/backup/"],
    ["uv", "run", "pytest", "-k", "SomeLongClassNameForTesting2Things"],
    ["docker", "run", "-p", "8080:80", "-u", "1000:1000", "nginx"],
]


def test_corpus_leaks_no_seeded_secret_and_keeps_the_harmless_parts():
    leaks, lost, secrets = [], [], 0
    for argv, seeded, harmless in CORPUS:
        out = scrub_args(argv)
        text = "\n".join(out)
        assert isinstance(out, list) and all(isinstance(a, str) for a in out)
        secrets += len(seeded)
        leaks += [f"{s!r} in {out}" for s in seeded if s in text]
        lost += [f"{h!r} not in {out}" for h in harmless if h not in text]
    assert len(CORPUS) >= 30
    assert not leaks, f"{len(leaks)} leaks out of {secrets} secrets:\n" + "\n".join(leaks)
    assert not lost, "harmless parts lost:\n" + "\n".join(lost)


@pytest.mark.parametrize("argv", HARMLESS, ids=lambda argv: str(argv[0]).rpartition("/")[2])
def test_harmless_command_lines_are_recorded_unchanged(argv):
    assert scrub_args(argv) == argv


def test_a_scrubber_failure_records_a_marker_instead_of_raising(monkeypatch):
    from stallwatch.instrument import scrub

    def broken(*args: object) -> str:
        raise RuntimeError("injected")

    monkeypatch.setattr(scrub, "_argument", broken)
    assert scrub_args(["ssh", "--password=x"]) == [UNSCRUBBABLE]
    monkeypatch.setattr(scrub, "_to_text", broken)
    assert executable_name("/usr/bin/ssh") == "?"


def test_the_executable_keeps_its_path_but_loses_url_user_info():
    assert scrub_args(["/opt/tool-3f2a9c0b7e1d4f6a8b5c2e9d1a7f3b6c/bin/run"])[0].endswith("/bin/run")
    assert scrub_args(["https://bob:ExePw-1@dl.example.com/tool", "-v"]) == [
        f"https://{REDACTED}@dl.example.com/tool",
        "-v",
    ]


def test_the_same_key_gives_the_same_fingerprint_wherever_it_lives():
    one = scrub_args(["ssh", "-i", "/home/a/.ssh/id_ed25519", "h"])
    two = scrub_args(["ssh", "-o", "IdentityFile=/root/keys/id_ed25519", "h"])
    assert one[2] == fingerprint("id_ed25519") and two[2] == "IdentityFile=" + fingerprint("id_ed25519")


def test_bounds_many_and_huge_arguments():
    out = scrub_args(["echo"] * 10_000)
    assert len(out) == MAX_ARGS and out[-1] == f"[... {10_000 - MAX_ARGS + 1} more]"
    out = scrub_args(["echo", "x" * 100_000, "y " * 50_000, b"z" * 100_000])
    assert all(len(a) <= MAX_ARG_CHARS for a in out) and "truncated" in out[1]
    assert scrub_args(iter(["a"] * 100))[-1] == "[... more]"


def test_a_secret_cut_by_the_scan_limit_is_not_half_recorded():
    out = scrub_args(["app", "--password " + "CutSecret" * 1000, "--next"])
    assert "CutSecret" not in "".join(out) and out[-1] == "--next"
    out = scrub_args(["app", "x" * 4000 + " https://u:" + "CutUrlPw" * 50 + "@host"])
    assert "CutUrlPw" not in "".join(out)


def test_extra_patterns_from_the_setting():
    patterns = compile_patterns(" foo , , ba[rz]")
    assert len(patterns) == 2 and compile_patterns("") == ()
    assert scrub_args(["app", "--foo-bar=x1", "FOO_THING=x2", "--baz", "x3"], patterns) == [
        "app",
        f"--foo-bar={REDACTED}",
        f"FOO_THING={REDACTED}",
        "--baz",
        REDACTED,
    ]
    assert scrub_args(["app", "--foo-bar=x1"]) == ["app", "--foo-bar=x1"]
    with pytest.raises(ValueError, match=r"MY_SETTING.*\(unclosed"):
        compile_patterns("ok,(unclosed", "MY_SETTING")
    with pytest.raises(ValueError, match="STALLWATCH_SCRUB_PATTERNS"):
        compile_patterns("[")


@pytest.mark.parametrize(
    ("program", "name"),
    [
        ("/usr/bin/ssh", "ssh"),
        ("ssh", "ssh"),
        (b"/usr/bin/curl", "curl"),
        (b"/bin/\xff\xfe", "\\xff\\xfe"),
        (Path("/opt/app/bin/worker"), "worker"),
        ("PGPASSWORD=x psql -h h", "psql"),
        ("A=1 B='two words' /usr/bin/env python3", "env"),
        ("/usr/local/bin/", "bin"),
        (None, "?"),
        (42, "?"),
        ("", "?"),
        (b"", "?"),
        ("   ", "?"),
        ("PGPASSWORD=only", "?"),
        ("https://u:ExeNamePw@host", f"{REDACTED}@host"),
        ("/bin/" + "x" * 200, "x" * MAX_NAME_CHARS),
        ("x" * 10_000, "?"),  # a first word cut by the scan limit is dropped, like any cut word
    ],
)
def test_executable_name(program, name):
    assert executable_name(program) == name


class Hostile:
    def __str__(self) -> str:
        raise RuntimeError("no")


ODD = st.one_of(
    st.text(max_size=60),
    st.binary(max_size=60),
    st.none(),
    st.integers(),
    st.floats(),
    st.just(Hostile()),
    st.just(10**5000),
    st.builds(Path, st.text(max_size=20)),
    st.integers(5_000, 20_000).map(lambda n: "ab=c " * n),
    st.integers(5_000, 20_000).map(lambda n: "q" * n),
    st.integers(17_000, 20_000).map(lambda n: b"\xff" * n),
    st.sampled_from(["--password", "-i", "-p", "sh", "-c", "ssh", "login", "htpasswd", "-b", "Authorization:"]),
)


def check_bounded(out: object) -> None:
    assert isinstance(out, list) and 1 <= len(out) <= MAX_ARGS and out != [UNSCRUBBABLE]
    for arg in out:
        assert isinstance(arg, str) and len(arg) <= MAX_ARG_CHARS
        arg.encode("utf-8")  # no lone surrogates


@settings(max_examples=200, deadline=None)
@given(st.lists(ODD, min_size=1, max_size=80))
def test_any_input_is_scrubbed_within_bounds(args):
    check_bounded(scrub_args(args))
    for arg in args[:5]:
        name = executable_name(arg)
        assert isinstance(name, str) and 1 <= len(name) <= MAX_NAME_CHARS


@settings(max_examples=50, deadline=None)
@given(st.one_of(st.none(), st.integers(), st.text(max_size=30), st.just(Hostile()), st.just(object())))
def test_a_non_list_argument_is_still_handled(args):
    check_bounded(scrub_args(args))
    check_bounded(scrub_args(["a", "--token=x"], extra=args))


SECRET_NAMES = [
    "password",
    "db-password",
    "PGPASSWORD",
    "passwd",
    "pass",
    "api_key",
    "apikey",
    "ACCESS_KEY",
    "private-key",
    "key",
    "auth-token",
    "token",
    "client_secret",
    "AWS_SECRET_ACCESS_KEY",
    "credentials",
    "authorization",
    "cookie",
    "session-id",
    "x-amz-signature",
    "sig",
]
FILLER = st.one_of(
    st.text(alphabet="abcdefgh0123456789 ./", max_size=20),
    st.sampled_from(["-N", "-v", "--verbose", "--region", "eu-west-1", "host.example.com", "-o", "Port=22", "--"]),
)
# Seeded secrets start with "ZQ", which no filler can produce.
SECRET = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%^*()_+-.~:,;&=@/ é", max_size=20
)
URL_SECRET = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!$%*()_+-.~:,;&=@", max_size=20
)


@st.composite
def seeded_command(draw: st.DrawFn) -> tuple[list[str], str]:
    name = draw(st.sampled_from(SECRET_NAMES))
    name = draw(st.sampled_from([name, name.upper(), name.lower()]))
    form = draw(st.sampled_from(["--eq", "--sep", "-single", "KEY=", "url", "shell", "quoted", "identity"]))
    secret = "ZQ" + draw(URL_SECRET if form in ("url", "shell") else SECRET)
    if form == "--eq":
        seeded = [f"--{name}={secret}"]
    elif form == "--sep":
        seeded = [f"--{name}", secret]
    elif form == "-single":
        seeded = [f"-{name}", secret]
    elif form == "KEY=":
        seeded = [f"{name}={secret}"]
    elif form == "url":
        scheme = draw(st.sampled_from(["https", "ssh", "postgresql", "redis", "git+ssh"]))
        seeded = [f"{scheme}://user:{secret}@db.example.com/x"]
    elif form == "shell":
        seeded = [f"{name}={secret} psql -h db.example.com"]
    elif form == "quoted":  # SECRET holds no quote
        seeded = [draw(st.sampled_from([f'tool --{name} "{secret}" -h db', f"tool --{name}='{secret}' -h db"]))]
    else:
        directory = "ZQdir" + draw(st.text(alphabet="abcdef0123456789-_", max_size=8))
        secret = "ZQkey" + draw(st.text(alphabet="abcdef0123456789-_.", max_size=8))
        seeded = ["ssh", draw(st.sampled_from(["-i", "--identity"])), f"~/{directory}/{secret}"]
    program = draw(st.sampled_from(["app", "/usr/bin/ssh", "curl", "docker", "env", "sudo", "kubectl", "sh"]))
    before = draw(st.lists(FILLER, max_size=5))
    after = draw(st.lists(FILLER, max_size=5))
    return [program, *before, *seeded, *after], secret


@settings(max_examples=200, deadline=None)
@given(seeded_command())
def test_a_secret_in_a_secret_position_never_survives(case):
    argv, secret = case
    out = scrub_args(argv)
    check_bounded(out)
    text = "\n".join(out)
    assert "ZQ" not in text, f"seeded secret {secret!r} leaked: {argv} -> {out}"
    assert re.search(r"\[REDACTED\]|key:[0-9a-f]{12}", text), out
