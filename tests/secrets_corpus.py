"""The one corpus of secrets for the whole test-suite.

`CORPUS` holds real-looking command lines with seeded secrets; the other lists hold secrets as they reach
stallwatch by other routes: URLs with user-info, tokens in query strings, environment variables, ssh options,
bare tokens, a Nebius token and request payload. `test_scrub` runs the scrubber over the command lines,
`test_secrets` runs every instrumentation end to end with all of them, and the leak guard in `conftest`
checks every log record of the `stallwatch` loggers against `SECRETS` during every test.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path, PurePosixPath

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

# ---- secrets by other routes than a command line ---------------------------------------------------

# URLs with user-info, and tokens in query strings.
URLS: list[tuple[str, tuple[str, ...]]] = [
    ("https://deploy:UrlUserinfoPw-8101@git.example.com/org/repo.git", ("UrlUserinfoPw-8101",)),
    ("postgresql://app:UrlPgPw-8102@db.internal:5432/app?sslmode=require", ("UrlPgPw-8102",)),
    ("redis://:UrlRedisPw-8103@cache.internal:6379/0", ("UrlRedisPw-8103",)),
    ("https://api.example.com/v1/items?access_token=UrlQueryTok-8104&page=2", ("UrlQueryTok-8104",)),
    (
        "https://hooks.example.com/in?api_key=UrlQueryKey-8105&sig=UrlQuerySig-8106",
        ("UrlQueryKey-8105", "UrlQuerySig-8106"),
    ),
]

# Environment-style KEY=VALUE pairs: given to children as their environment, and written on command lines.
ENVIRONMENT: dict[str, str] = {
    "PGPASSWORD": "EnvPgPassword-8201",
    "AWS_SECRET_ACCESS_KEY": "EnvAwsSecretKey-8202",
    "GITHUB_TOKEN": "ghp_EnvGithubToken8203abcdefghijklmnop",
    "DATABASE_URL": "postgresql://app:EnvDatabaseUrlPw-8204@db.internal/app",
    "NEBIUS_IAM_TOKEN": "EnvNebiusIamToken-8205",
}
ENVIRONMENT_SECRETS = (
    "EnvPgPassword-8201", "EnvAwsSecretKey-8202", "EnvGithubToken8203", "EnvDatabaseUrlPw-8204",
    "EnvNebiusIamToken-8205",
)  # fmt: skip

# ssh `-o` options of a tunnel (as `ssh_config(5)` takes them), and its identity file's directory and name.
SSH_OPTIONS: dict[str, str] = {
    "SetEnv": "DEPLOY_TOKEN=SshSetEnvToken-8301",
    "IdentityFile": "/run/keys-SshOptionKeyDir-8302/id_SshOptionKey_8303",
}
SSH_IDENTITY_DIR = "SshIdentityDir-8304"
SSH_IDENTITY_NAME = "id_SshIdentity_8305"
SSH_SECRETS = (
    "SshSetEnvToken-8301",
    "SshOptionKeyDir-8302",
    "id_SshOptionKey_8303",
    SSH_IDENTITY_DIR,
    SSH_IDENTITY_NAME,
)

# Bare tokens of well-known shapes.
TOKENS: list[str] = [
    "ghp_BareGithubToken8401abcdefghijklmnopq",
    "glpat-BareGitlabToken8402abcdefgh",
    "xoxb-BareSlackToken-8403-abcdefghij",
    "AKIABARETOKEN8404XYZ",
    "sk_live_BareStripeToken8405abcdef",
]

# A Nebius caller's IAM token, and secrets inside a request's payload (which stallwatch never reads).
NEBIUS_TOKEN = "NebiusIamToken-8501"
NEBIUS_PAYLOAD: dict[str, str] = {
    "name": "vm-NebiusNameSecret-8502",
    "label": "NebiusLabelSecret-8503",
    "cloud_init": "#cloud-config\npassword: NebiusCloudInitPw-8504\n",
}
NEBIUS_SECRETS = (NEBIUS_TOKEN, "NebiusNameSecret-8502", "NebiusLabelSecret-8503", "NebiusCloudInitPw-8504")

# Arguments of executor work items.
EXECUTOR_ARGS = ("ExecutorArgSecret-8601", "--password=ExecutorKwPw-8602")
EXECUTOR_SECRETS = ("ExecutorArgSecret-8601", "ExecutorKwPw-8602")


def _distinctive(secret: str) -> bool:
    """Long and odd enough that finding it in any output can only mean a leak (not "correct" or "8642")."""
    return len(secret) >= 8 and any(c.isdigit() for c in secret) and not re.search(r"[\s'\"\\]", secret)


# Every secret the suite seeds anywhere, as searched for in stallwatch's outputs.
SECRETS: tuple[str, ...] = tuple(
    sorted(
        secret
        for secret in {
            *(secret for _, seeded, _ in CORPUS for secret in seeded),
            *(secret for _, seeded in URLS for secret in seeded),
            *ENVIRONMENT_SECRETS,
            *SSH_SECRETS,
            *TOKENS,
            *NEBIUS_SECRETS,
            *EXECUTOR_SECRETS,
        }
        if _distinctive(secret)
    )
)
_SEARCH = re.compile("|".join(re.escape(secret) for secret in sorted(SECRETS, key=len, reverse=True)))


def leaked(output: str | bytes) -> list[str]:
    """The corpus secrets found in `output`: text, or bytes such as a protobuf payload or a journal file."""
    text = output.decode("latin-1") if isinstance(output, (bytes, bytearray)) else output
    return sorted({match.group() for match in _SEARCH.finditer(text)})
