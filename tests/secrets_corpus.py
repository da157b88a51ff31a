"""The one corpus of secrets for the whole test-suite.

`CORPUS` holds real-looking command lines with seeded secrets; the other lists hold secrets as they reach
stallwatch by other routes: URLs with user-info, tokens in query strings, environment variables, ssh options,
bare tokens, a Nebius token and request payload. `test_scrub` runs the scrubber over the command lines,
`test_secrets` runs every instrumentation end to end with all of them, and the leak guard in `conftest`
checks every log record of the `stallwatch` loggers against `SECRETS` during every test.
"""

from __future__ import annotations

import base64
import hashlib
import random
import re
import string
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

# ---- token shapes of public secret-scanning rule sets ----------------------------------------------
# The layouts gitleaks (config/gitleaks.toml) and detect-secrets (its plugins) document, filled with characters
# from a fixed-seed generator: test data of the right shape, never a real credential.
_fill_rng = random.Random(20260601)
_B62 = string.ascii_letters + string.digits
_B64URL = _B62 + "-_"
_B64 = _B62 + "+/"
_HEXL = "0123456789abcdef"
_UPPER_DIGITS = string.ascii_uppercase + string.digits


def _fill(alphabet: str, size: int) -> str:
    """`size` characters of `alphabet`, at least one of them a digit when the alphabet has digits."""
    while True:
        text = "".join(_fill_rng.choice(alphabet) for _ in range(size))
        if not any(c.isdigit() for c in alphabet) or any(c.isdigit() for c in text):
            return text


def _jwt() -> str:
    header, claims = b'{"alg":"RS256","typ":"JWT"}', b'{"sub":"corpus-5301","iat":1717200000}'
    parts = [base64.urlsafe_b64encode(part).decode().rstrip("=") for part in (header, claims)]
    return ".".join([*parts, _fill(_B64URL, 43)])


RULE_SET_TOKENS: dict[str, str] = {
    "aws-access-key-id": "AKIA" + _fill(_UPPER_DIGITS, 16),
    "aws-secret-access-key": _fill(_B64, 40),
    "github-pat": "ghp_" + _fill(_B62, 36),
    "github-fine-grained-pat": "github_pat_" + _fill(_B62 + "_", 82),
    "gitlab-pat": "glpat-" + _fill(_B64URL, 20),
    "gitlab-runner-token": "glrt-" + _fill(_B64URL, 20),
    "slack-bot-token": "xoxb-" + _fill(string.digits, 12) + "-" + _fill(string.digits, 12) + "-" + _fill(_B62, 24),
    "slack-app-token": "xapp-1-" + _fill(_UPPER_DIGITS, 11) + "-" + _fill(string.digits, 13) + "-" + _fill(_HEXL, 64),
    "stripe-secret-key": "sk_live_" + _fill(_B62, 24),
    "stripe-webhook-secret": "whsec_" + _fill(_B62, 32),
    "openai-api-key": "sk-proj-" + _fill(_B64URL, 74) + "T3BlbkFJ" + _fill(_B64URL, 74),
    "anthropic-api-key": "sk-ant-api03-" + _fill(_B64URL, 93) + "AA",
    "gcp-api-key": "AIza" + _fill(_B64URL, 35),
    "google-oauth-access-token": "ya29." + _fill(_B64URL, 80),
    "google-oauth-client-secret": "GOCSPX-" + _fill(_B64URL, 28),
    "npm-token": "npm_" + _fill(_B62, 36),
    "pypi-token": "pypi-AgEIcHlwaS5vcmc" + _fill(_B64URL, 70),
    "rubygems-token": "rubygems_" + _fill(_HEXL, 48),
    "vault-service-token": "hvs." + _fill(_B64URL, 90),
    "huggingface-token": "hf_" + _fill(string.ascii_letters, 34),
    "sendgrid-api-key": "SG." + _fill(_B64URL, 22) + "." + _fill(_B64URL, 43),
    "twilio-api-key": "SK" + _fill(_HEXL, 32),
    "databricks-token": "dapi" + _fill(_HEXL, 32),
    "digitalocean-pat": "dop_v1_" + _fill(_HEXL, 64),
    "doppler-token": "dp.pt." + _fill(_B62, 43),
    "dynatrace-token": "dt0c01." + _fill(_UPPER_DIGITS, 24) + "." + _fill(_UPPER_DIGITS, 64),
    "shopify-access-token": "shpat_" + _fill(_HEXL, 32),
    "planetscale-token": "pscale_tkn_" + _fill(_B64URL, 43),
    "postman-api-key": "PMAK-" + _fill(_HEXL, 24) + "-" + _fill(_HEXL, 34),
    "pulumi-token": "pul-" + _fill(_HEXL, 40),
    "prefect-token": "pnu_" + _fill(_B62, 36),
    "sentry-user-token": "sntryu_" + _fill(_HEXL, 64),
    "linear-api-key": "lin_api_" + _fill(_B62, 40),
    "notion-token": "ntn_" + _fill(string.digits, 11) + _fill(_B62, 35),
    "heroku-api-key-v2": "HRKU-AA" + _fill(_B64URL, 58),
    "age-secret-key": "AGE-SECRET-KEY-1" + _fill("QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L", 58),
    "square-access-token": "sq0atp-" + _fill(_B64URL, 22),
    "mailgun-key": "key-" + _fill(_HEXL, 32),
    "mailchimp-key": _fill(_HEXL, 32) + "-us14",
    "telegram-bot-token": _fill(string.digits, 10) + ":AA" + _fill(_B64URL, 33),
    "discord-bot-token": "M" + _fill(_B64URL, 23) + "." + _fill(_B64URL, 6) + "." + _fill(_B64URL, 27),
    "jwt": _jwt(),
    "azure-ad-client-secret": _fill(_B62, 3) + "8Q~" + _fill(_B62 + "_~.-", 34),
    "openshift-token": "sha256~" + _fill(_B64URL, 43),
    "artifactory-api-key": "AKCp" + _fill(_B62, 69),
    "alibaba-access-key-id": "LTAI" + _fill(_B62, 20),
    "1password-service-account": "ops_eyJ" + _fill(_B64, 250),
    "grafana-cloud-token": "glc_" + _fill(_B62, 40),
    "grafana-service-account": "glsa_" + _fill(_B62, 32) + "_" + _fill(_HEXL, 8),
    "atlassian-api-token": "ATATT3" + _fill(_B64URL, 186),
    "azure-storage-account-key": _fill(_B64, 86) + "==",
    "hex-secret-64": _fill(_HEXL, 64),
    "openssh-private-key-body": "b3BlbnNzaC1rZXktdjEAAAAA" + _fill(_B64, 60),
}
# Where a bare token lands on a command line: no name says it is secret, only its shape.
_POSITIONS = (
    lambda t: ["deploy-tool", "push", "--region", "eu-west-1", t],
    lambda t: ["worker", f"--value={t}", "--verbose"],
    lambda t: [f"run-job --target prod {t} && echo done"],
    lambda t: ["client", "--json", f'{{"value": "{t}", "retries": 3}}'],
    lambda t: [f"DEPLOY_VALUE={t} ./release.sh --dry-run"],
)
RULE_SET_COMMANDS: list[tuple[list[object], tuple[str, ...], tuple[str, ...]]] = [
    (_POSITIONS[number % len(_POSITIONS)](token), (token,), ()) for number, token in enumerate(RULE_SET_TOKENS.values())
]
_PGP_BODY = _fill(_B64, 64)
KEY_MATERIAL: list[tuple[list[object], tuple[str, ...], tuple[str, ...]]] = [
    (
        [
            "gpg",
            "--import",
            f"-----BEGIN PGP PRIVATE KEY BLOCK-----\n\n{_PGP_BODY}\n=Ab3d\n-----END PGP PRIVATE KEY BLOCK-----",
        ],
        (_PGP_BODY,),
        ("gpg", "--import"),
    ),
    (
        ["putty-import", f"PuTTY-User-Key-File-3: ssh-ed25519\nEncryption: none\nPrivate-Lines: 1\n{_PGP_BODY[:40]}"],
        (_PGP_BODY[:40],),
        ("putty-import",),
    ),
]

# Credentials glued to (or following) the short options of the tools that take them that way, and secrets
# carried in the path of a URL.
_OPENSSL_KEY = "5191" + _fill(_HEXL, 60)
SHORT_OPTION_CREDENTIALS: list[tuple[list[object], tuple[str, ...], tuple[str, ...]]] = [
    (
        ["smbclient", "-Uadmin%SmbGlued-5170", "//files.example.com/share"],
        ("SmbGlued-5170",),
        ("-Uadmin%", "//files.example.com/share"),
    ),
    (["rpcclient", "-U", "ops%RpcSep-5171", "dc1.example.com"], ("RpcSep-5171",), ("ops%", "dc1.example.com")),
    (
        ["lftp", "-u", "deploy,LftpPw-5172", "sftp://files.example.com"],
        ("LftpPw-5172",),
        ("deploy,", "sftp://files.example.com"),
    ),
    (
        ["sqlplus", "-s", "scott/OraclePw-5173@db.example.com:1521/ORCL", "@report.sql"],
        ("OraclePw-5173",),
        ("scott/", "@db.example.com:1521/ORCL", "@report.sql"),
    ),
    (
        ["expdp", "system/ExpdpPw-5174@prod", "directory=dp_dir", "dumpfile=full.dmp"],
        ("ExpdpPw-5174",),
        ("system/", "@prod", "dumpfile=full.dmp"),
    ),
    (
        ["xfreerdp", "/v:10.0.0.7", "/u:admin", "/p:RdpPw-5175", "/cert:ignore"],
        ("RdpPw-5175",),
        ("/v:10.0.0.7", "/u:admin", "/p:", "/cert:ignore"),
    ),
    (["rdesktop", "-u", "admin", "-pRdesktopPw-5176", "10.0.0.7"], ("RdesktopPw-5176",), ("admin", "10.0.0.7")),
    (
        ["ipmitool", "-I", "lanplus", "-H", "10.1.1.1", "-U", "root", "-PIpmiPw-5177", "chassis", "status"],
        ("IpmiPw-5177",),
        ("lanplus", "10.1.1.1", "chassis"),
    ),
    (
        ["mosquitto_pub", "-h", "mqtt.example.com", "-u", "sensor", "-PMqttPw-5178", "-t", "t/1", "-m", "42"],
        ("MqttPw-5178",),
        ("mqtt.example.com", "sensor", "t/1"),
    ),
    (
        [
            "snmpwalk",
            "-v3",
            "-l",
            "authPriv",
            "-u",
            "mon",
            "-a",
            "SHA",
            "-ASnmpAuth-5179",
            "-x",
            "AES",
            "-XSnmpPriv-5180",
            "10.0.0.1",
        ],
        ("SnmpAuth-5179", "SnmpPriv-5180"),
        ("authPriv", "10.0.0.1"),
    ),
    (["snmpget", "-v2c", "-cSnmpComm-5181", "10.0.0.1", "sysUpTime.0"], ("SnmpComm-5181",), ("-v2c", "sysUpTime.0")),
    (
        ["mongodump", "--host", "db.example.com", "-u", "backup", "-pMongoGlued-5182"],
        ("MongoGlued-5182",),
        ("db.example.com", "backup"),
    ),
    (["unrar", "x", "-pUnrarPw-5183", "archive.rar"], ("UnrarPw-5183",), ("unrar", "archive.rar")),
    (["rar", "a", "-hpRarHeader-5184", "backup.rar", "data/"], ("RarHeader-5184",), ("backup.rar", "data/")),
    (
        ["ncftpput", "-u", "web", "-pNcftpPw-5185", "ftp.example.com", "/www", "index.html"],
        ("NcftpPw-5185",),
        ("ftp.example.com", "index.html"),
    ),
    (["keydb-cli", "-aKeydbPw-5186", "PING"], ("KeydbPw-5186",), ("keydb-cli", "PING")),
    (
        ["nmcli", "device", "wifi", "connect", "Office-5G", "password", "WifiPw-5187"],
        ("WifiPw-5187",),
        ("connect", "Office-5G", "password"),
    ),
    (
        ["nmcli", "con", "modify", "office", "wifi-sec.psk", "WifiPsk-5188"],
        ("WifiPsk-5188",),
        ("modify", "wifi-sec.psk"),
    ),
    (
        ["bcp", "db.dbo.orders", "out", "orders.dat", "-S", "sql.example.com", "-U", "sa", "-PBcpPw-5189"],
        ("BcpPw-5189",),
        ("orders.dat", "sql.example.com"),
    ),
    (
        ["sh", "-c", "mysqldump -uroot -pShellGlued-5190 shop > /backup/shop.sql"],
        ("ShellGlued-5190",),
        ("mysqldump -uroot -p", "/backup/shop.sql"),
    ),
    (
        ["sudo", "mysql", "-uadmin", "-pSudoGlued-5191", "-e", "SHOW DATABASES"],
        ("SudoGlued-5191",),
        ("sudo", "-uadmin", "SHOW DATABASES"),
    ),
    (
        ["openssl", "enc", "-aes-256-cbc", "-K", _OPENSSL_KEY, "-iv", "00", "-in", "plain.txt"],
        (_OPENSSL_KEY,),
        ("-aes-256-cbc", "plain.txt"),
    ),
]
URL_PATH_SECRETS: list[tuple[list[object], tuple[str, ...], tuple[str, ...]]] = [
    (
        [
            "curl",
            "-X",
            "POST",
            "-d",
            "{}",
            "https://hooks.slack.com/services/T0CORPUS1/B0CORPUS2/slackhooksecretfivetwo",
        ],
        ("slackhooksecretfivetwo",),
        ("https://hooks.slack.com/services/",),
    ),
    (
        ["curl", "-d", "@m.json", "hooks.slack.com/services/T0CORPUS1/B0CORPUS2/SlackBareHost5192xy"],
        ("SlackBareHost5192xy",),
        ("hooks.slack.com/services/",),
    ),
    (
        ["curl", "https://discord.com/api/webhooks/112233445566778899/DiscordHookSecret-5193_xyzABC"],
        ("DiscordHookSecret-5193_xyzABC",),
        ("https://discord.com/api/webhooks/",),
    ),
    (
        ["curl", "https://api.telegram.org/bot5194123456:AAtelegramCorpusToken5194abcdefghijk/sendMessage"],
        ("AAtelegramCorpusToken5194abcdefghijk",),
        ("https://api.telegram.org/bot", "/sendMessage"),
    ),
    (
        ["curl", "https://mattermost.example.com/hooks/mmhooksecret5195qwertyuiop"],
        ("mmhooksecret5195qwertyuiop",),
        ("https://mattermost.example.com/hooks/",),
    ),
    (
        ["curl", "https://example.webhook.office.com/webhookb2/5196aaaa-1111@2222/IncomingWebhook/5196bbbb/cccc"],
        ("5196aaaa-1111@2222", "5196bbbb"),
        ("https://example.webhook.office.com/webhookb2/",),
    ),
    (
        ["curl", "https://maker.ifttt.com/trigger/deploy/with/key/IftttKey5197abc"],
        ("IftttKey5197abc",),
        ("https://maker.ifttt.com/trigger/deploy/with/key/",),
    ),
    (
        ["curl", "https://hc-ping.com/5198aaaa-1111-4222-8333-944445555666"],
        ("5198aaaa-1111-4222-8333-944445555666",),
        ("https://hc-ping.com/",),
    ),
    (
        ["curl", "https://events.pagerduty.com/integration/PagerDutyKey5199xyz/enqueue"],
        ("PagerDutyKey5199xyz",),
        ("https://events.pagerduty.com/integration/",),
    ),
    (
        ["curl", "https://hooks.zapier.com/hooks/catch/5200123/ZapierHook5200/"],
        ("ZapierHook5200", "5200123"),
        ("https://hooks.zapier.com/hooks/",),
    ),
    (
        ["sh", "-c", "curl -fsS -d @payload.json https://hooks.slack.com/workflows/T0C/A0C/5201/SlackWorkflow5201abc"],
        ("SlackWorkflow5201abc",),
        ("curl -fsS -d @payload.json https://hooks.slack.com/workflows/",),
    ),
    (
        ["wget", "-q", "https://downloads.example.com/private/Xk29fLq0VbN7cTr4WmZp1sYd/report.pdf"],
        ("Xk29fLq0VbN7cTr4WmZp1sYd",),
        ("https://downloads.example.com/private/", "/report.pdf"),
    ),
]
CORPUS += [*SHORT_OPTION_CREDENTIALS, *URL_PATH_SECRETS, *RULE_SET_COMMANDS, *KEY_MATERIAL]  # fmt: skip

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
    # What a server spawns every day: each must read as it was written.
    ["git", "checkout", "3f2a9c0b7e1d4f6a8b5c2e9d1a7f3b6c0d4e5f6a"],  # a commit name given to git
    ["git", "log", "--oneline", "origin/main..HEAD"],
    ["git", "clone", "https://github.com/psf/requests.git"],
    ["git", "commit", "-m", "Fix the flaky retry test on CI"],
    ["git", "rebase", "-i", "HEAD~3"],
    ["git", "show", "a1b2c3d"],
    ["sh", "-c", "cd /srv/app && git fetch origin && git reset --hard 9c1e2d3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d"],
    [
        "docker",
        "run",
        "--rm",
        "-it",
        "-p",
        "8080:80",
        "-v",
        "/srv/data:/data:ro",
        "-e",
        "LOG_LEVEL=debug",
        "--name",
        "web-1",
        "nginx:1.25-alpine",
    ],
    ["docker", "exec", "-it", "web-1", "sh"],
    ["docker", "build", "-t", "registry.example.com/team/api:2024.06.1", "-f", "docker/Dockerfile.prod", "."],
    ["kubectl", "-n", "prod", "rollout", "restart", "deployment/api-server"],
    ["kubectl", "logs", "-f", "api-server-7d9f8b6c5-x2klp", "-c", "app", "--since=10m"],
    ["kubectl", "port-forward", "svc/postgres", "5432:5432"],
    ["kubectl", "apply", "-f", "k8s/overlays/production/kustomization.yaml"],
    ["kubectl", "get", "secret", "db-credentials", "-o", "yaml"],
    ["ssh", "-L", "8080:localhost:80", "host.example.com"],
    ["ssh", "-o", "ServerAliveInterval=30", "-p", "2222", "deploy@10.20.30.40", "uptime"],
    ["scp", "-r", "build/", "deploy@files.example.com:/var/www/app/"],
    ["pip", "install", "pkg==1.2.3", "requests>=2.31,<3"],
    ["python", "-m", "module", "--flag", "value"],
    ["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1"],
    ["uvicorn", "app.main:app", "--host", "0.0.0.0", "--port", "8000", "--workers", "4"],
    ["gunicorn", "-w", "4", "-b", "0.0.0.0:8000", "myproject.wsgi:application"],
    ["cat", "/var/log/nginx/access.log"],
    ["cat", "/usr/share/icons/Adwaita/48x48/actions/insert-object-symbolic.png"],
    ["tar", "-czf", "/backups/db-2024-06-01.tar.gz", "-C", "/var/lib/postgresql", "data"],
    ["rsync", "-avz", "--exclude", ".git", "./", "backup@nas.local:/volume1/backups/"],
    ["ping", "-c", "3", "192.168.1.1"],
    ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "https://api.example.com/v2/health"],
    ["curl", "http://[2001:db8::1]:8080/metrics"],
    ["curl", "https://api.example.com/v1/oauth/token/refresh"],
    ["dig", "+short", "api.internal.example.com", "AAAA"],
    ["cp", "/tmp/3fa85f64-5717-4562-b3fc-2c963f66afa6.json", "/data/uploads/"],
    ["ls", "-la", "/home/alice/Projects/MyApp2/src"],
    ["psql", "-h", "db.example.com", "-U", "app", "-d", "appdb", "-c", "SELECT count(*) FROM users"],
    ["mysql", "-u", "root", "-p", "shop"],
    ["terraform", "plan", "-var-file=envs/prod.tfvars", "-out=plan.out"],
    ["ansible-playbook", "-i", "inventory/prod.ini", "site.yml", "--limit", "webservers"],
    ["helm", "upgrade", "--install", "api", "./charts/api", "--namespace", "prod", "--set", "image.tag=v1.4.2"],
    ["aws", "s3", "cp", "s3://my-bucket/reports/2024/06/summary.csv", "."],
    ["gcloud", "compute", "instances", "list", "--project", "my-project-123456"],
    ["node", "dist/server.js", "--max-old-space-size=4096"],
    ["java", "-Xmx2g", "-jar", "build/libs/service-1.0.0-SNAPSHOT.jar", "--spring.profiles.active=prod"],
    ["ffmpeg", "-i", "input.mp4", "-c:v", "libx264", "-crf", "23", "output.mp4"],
    ["journalctl", "-u", "nginx.service", "--since", "2024-06-01 10:00:00"],
    ["systemctl", "restart", "postgresql@15-main"],
    ["pytest", "-q", "tests/test_api.py::TestUserEndpoints::test_create_user_returns_201"],
    ["make", "-j8", "CFLAGS=-O2 -g"],
    ["go", "test", "./...", "-run", "TestHandleRequestWithRetries"],
    ["cargo", "build", "--release", "--target", "x86_64-unknown-linux-gnu"],
    ["openssl", "x509", "-in", "/etc/ssl/certs/DigiCert_Global_Root_G2.pem", "-noout", "-text"],
    ["sha256sum", "dist/app-linux-amd64.tar.gz"],
    ["mongosh", "--host", "db.example.com", "--authenticationDatabase", "admin", "-u", "reader"],
    ["vault", "kv", "get", "secret/myapp/config"],
    ["ssh-keygen", "-t", "ed25519", "-C", "alice@example.com", "-N", ""],
    ["nvidia-smi", "--query-gpu=name,memory.used", "--format=csv,noheader"],
    ["bash", "-lc", "source .venv/bin/activate && python manage.py migrate --noinput"],
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
    odd = any(c.isdigit() for c in secret) or len(secret) >= 20  # a long generated token may hold no digit
    return len(secret) >= 8 and odd and not re.search(r"[\s'\"\\]", secret)


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
