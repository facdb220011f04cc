"""Who may call what: bearer tokens in four scopes, and the policy both servers enforce.

Scopes. Each route of `streamtune api` and `streamtune serve` needs one scope:

| scope       | routes                                                                          |
|-------------|---------------------------------------------------------------------------------|
| `admin`     | submit, apply, delete, pause/resume, promote (aliases), split: everything else  |
| `read`      | status, versions, promotions, DLQ, pipelines, serving stats, guard, /metrics, /openapi.json |
| `feedback`  | POST /v1/feedback only (the token pages embed through /feedback.js)             |
| `inference` | /v1/completions, /v1/chat/completions, GET /v1/models (OpenAI's `api_key`)        |

An `admin` token passes every check (it is the operator's); the others pass only their own.
Health checks (/healthz, /readyz) and the console's static files carry no data and need no
token.

Tokens. Several per scope, from any of these at once (their union):

- a tokens file (`--tokens-file F` or $STREAMTUNE_TOKENS_FILE): one `scope token` or
  `scope: token` per line; blank lines and `#` comments are ignored;
- a directory ($STREAMTUNE_TOKENS_DIR), e.g. a mounted Kubernetes Secret: files named
  `admin`, `read`, `feedback`, `inference`, each holding tokens one per line (`#` comments
  allowed); other files (Kubernetes' `..data` links) are ignored;
- $STREAMTUNE_TOKENS_ADMIN, _READ, _FEEDBACK, _INFERENCE: comma-separated;
- the older single tokens: $STREAMTUNE_API_TOKEN or `--token-file` (a file holding one
  token) are `admin`; $STREAMTUNE_API_FEEDBACK_TOKEN is `feedback`.

A token is visible ASCII (what an HTTP header carries). One token value in two scopes is a
configuration error, even when one is `admin`: a token names one role, and a leaked feedback
token must not turn out to be the admin token as well.

Rotation without restart: the file and the directory are re-read when their modification
time changes, checked at most once a second. A re-read that fails (a half-written file, an
unknown scope) keeps the last good set and logs an error: write the new file beside the old
and rename it over (Kubernetes' Secret volumes swap the whole directory that way). Tokens are
compared through their SHA-256 digests with `hmac.compare_digest` against every configured
token (no early exit), and never logged: a caller is identified as `scope:<8 hex digits of
the digest>`.

Policy (`AccessPolicy`), for a server bound to `host`:

- any token configured: every route but the health checks needs a token of its scope, on
  any address: 401 without a known token, 403 with a token of another scope;
- no token, loopback (127.0.0.0/8, ::1, localhost): the development mode of old: anonymous
  callers may read and call inference, nothing else;
- no token, any other address: refused at start (ConfigError, exit 2) unless `insecure`
  (`--insecure`, for tests and demos only), which lets anonymous callers do everything and
  says so in a WARNING at start.

Authentication runs before routing reaches a handler (an ASGI middleware), so an anonymous
caller gets the same 401 for a model that exists and one that does not, for a body that
parses and one that does not.

>>> store = TokenStore(env={"STREAMTUNE_TOKENS_READ": "r-1,r-2", "STREAMTUNE_API_TOKEN": "adm"})
>>> policy = AccessPolicy(store, host="0.0.0.0")
>>> policy.authorize("Bearer r-2", "read").scope
'read'
>>> policy.authorize("Bearer adm", "inference").scope
'admin'
>>> policy.authorize("Bearer r-1", "admin")
Traceback (most recent call last):
...
streamtune.auth.Forbidden: this read token cannot do that: it needs an admin token
>>> policy.authorize(None, "read")
Traceback (most recent call last):
...
streamtune.auth.Unauthorized: missing or wrong bearer token
>>> parse_tokens_file("# ops\\nadmin: a-1\\nread r-1\\n", "tokens")
[('admin', 'a-1'), ('read', 'r-1')]
>>> is_loopback("127.0.0.2"), is_loopback("::1"), is_loopback("0.0.0.0"), is_loopback("10.0.0.1")
(True, True, False, False)
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional

from starlette.requests import Request

from core.errors import ConfigError, StreamtuneError

log = logging.getLogger("streamtune.auth")

SCOPES = ("admin", "read", "feedback", "inference")
PUBLIC = "public"  # a route needing no token: health checks, static console files
TOKEN_PATTERN = re.compile(r"[\x21-\x7e]+")
RELOAD_EVERY_S = 1.0


class Unauthorized(StreamtuneError):
    """No token, or one no scope knows: HTTP 401."""

    status = 401


class Forbidden(StreamtuneError):
    """A known token whose scope does not allow the call: HTTP 403."""

    status = 403


@dataclass(frozen=True)
class Principal:
    """Who called: the scope of the token and a short id of it (never the token itself)."""

    scope: str
    token_id: str

    @property
    def actor(self) -> str:
        """How logs (the promotion log) name the caller."""
        return f"{self.scope}:{self.token_id}" if self.token_id else self.scope


ANONYMOUS = Principal("anonymous", "")


def is_loopback(host: str) -> bool:
    """Whether a listener on `host` is reachable from this machine only."""
    host = (host or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allows(held: str, needed: str) -> bool:
    """Whether a token of scope `held` passes a check for `needed` (admin passes all)."""
    return needed == PUBLIC or held == "admin" or held == needed


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _check_token(token: str, source: str) -> str:
    if not TOKEN_PATTERN.fullmatch(token):
        raise ConfigError(f"{source}: a token must be visible ASCII characters, no spaces")
    return token


def parse_tokens_file(text: str, source: str) -> list[tuple[str, str]]:
    """(scope, token) per line of a tokens file: `scope token` or `scope: token`."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):  # a token may hold "#": only whole-line comments
            continue
        parts = re.split(r"\s*:\s*|\s+", line, maxsplit=1)
        if len(parts) != 2 or parts[0] not in SCOPES:
            # The line may hold a token: name its number, never its text.
            raise ConfigError(f"{source} line {number}: expected `SCOPE TOKEN` with SCOPE one of {', '.join(SCOPES)}")
        out.append((parts[0], _check_token(parts[1].strip(), f"{source} line {number}")))
    return out


def _read_text(path: Path, source: str) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise ConfigError(f"{source}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not a text file (UTF-8)") from None


def read_single_token(token_file: Optional[str], env_var: str = "STREAMTUNE_API_TOKEN",
                      env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The one token in `token_file` when given, else $`env_var`; None when neither has one.

    >>> read_single_token(None, "T", {"T": "abc"})
    'abc'
    """
    env = os.environ if env is None else env
    if not token_file:
        token, source = env.get(env_var) or None, env_var
    else:
        source = f"--token-file {token_file}"
        token = _read_text(Path(token_file), source).strip() or None
    return _check_token(token, source) if token is not None else None


class TokenStore:
    """Every configured token with its scope; the file and directory re-read when they change.

    `env` gives the STREAMTUNE_TOKENS_* and legacy variables (default: the process's);
    `tokens_file` / `tokens_dir` default to $STREAMTUNE_TOKENS_FILE / $STREAMTUNE_TOKENS_DIR;
    `token_file` is the legacy one-token admin file; `static` adds (scope, token) pairs.
    """

    def __init__(self, env: Optional[Mapping[str, str]] = None, tokens_file: Optional[str] = None,
                 tokens_dir: Optional[str] = None, token_file: Optional[str] = None,
                 static: Iterable[tuple[str, str]] = ()):
        env = os.environ if env is None else env
        self.tokens_file = Path(tokens_file or env.get("STREAMTUNE_TOKENS_FILE") or "") or None
        self.tokens_dir = Path(tokens_dir or env.get("STREAMTUNE_TOKENS_DIR") or "") or None
        if str(self.tokens_file) == ".":
            self.tokens_file = None
        if str(self.tokens_dir) == ".":
            self.tokens_dir = None
        fixed = list(static)
        for scope in SCOPES:
            var = f"STREAMTUNE_TOKENS_{scope.upper()}"
            fixed += [(scope, _check_token(t.strip(), var)) for t in env.get(var, "").split(",") if t.strip()]
        admin = read_single_token(token_file, "STREAMTUNE_API_TOKEN", env)
        if admin:
            fixed.append(("admin", admin))
        feedback = read_single_token(None, "STREAMTUNE_API_FEEDBACK_TOKEN", env)
        if feedback:
            fixed.append(("feedback", feedback))
        self._fixed = fixed
        self._lock = threading.Lock()
        self._checked_at = 0.0
        self._stamp = self._file_stamp()
        self._outbound: dict[str, str] = {}
        self._table = self._build(self._fixed + self._read_files())  # raises ConfigError at start

    # -- reading

    def _file_stamp(self) -> tuple:
        """What changes when the file or directory is rewritten (mtime, size, inode per file)."""
        stamp = []
        paths = [self.tokens_file] if self.tokens_file else []
        if self.tokens_dir:
            paths += [self.tokens_dir, *(self.tokens_dir / s for s in SCOPES)]
        for p in paths:
            try:
                st = p.stat()  # follows Kubernetes' symlinks to the current data
                stamp.append((str(p), st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                stamp.append((str(p), None))
        return tuple(stamp)

    def _read_files(self) -> list[tuple[str, str]]:
        out = []
        if self.tokens_file:
            source = f"tokens file {self.tokens_file}"
            out += parse_tokens_file(_read_text(self.tokens_file, source), source)
        if self.tokens_dir:
            if not self.tokens_dir.is_dir():
                raise ConfigError(f"STREAMTUNE_TOKENS_DIR {self.tokens_dir}: not a directory")
            for scope in SCOPES:
                path = self.tokens_dir / scope
                if path.exists():
                    for number, line in enumerate(_read_text(path, str(path)).splitlines(), 1):
                        line = line.strip()
                        if line and not line.startswith("#"):
                            out.append((scope, _check_token(line, f"{path} line {number}")))
        return out

    def _build(self, pairs: list[tuple[str, str]]) -> list[tuple[bytes, str]]:
        table: dict[bytes, str] = {}
        outbound: dict[str, str] = {}
        for scope, token in pairs:
            outbound.setdefault(scope, token)
            digest = _digest(token)
            if table.get(digest, scope) != scope:
                raise ConfigError(f"one token is configured in two scopes ({table[digest]} and {scope}): "
                                  "give each scope its own tokens")
            table[digest] = scope
        self._outbound = outbound
        return list(table.items())

    def _maybe_reload(self) -> None:
        if not (self.tokens_file or self.tokens_dir):
            return
        now = time.monotonic()
        with self._lock:
            if now - self._checked_at < RELOAD_EVERY_S:
                return
            self._checked_at = now
            stamp = self._file_stamp()
            if stamp == self._stamp:
                return
            try:
                table = self._build(self._fixed + self._read_files())
            except ConfigError as e:  # keep serving with the last good set; the message holds no token
                log.error("tokens not reloaded, the previous ones stay in force: %s", e)
                self._stamp = stamp
                return
            self._stamp, self._table = stamp, table
            log.info("tokens reloaded: %s", self.summary())

    # -- answering

    def scope_of(self, presented: str) -> Optional[Principal]:
        """The principal a presented token is, or None; constant time in the token's content."""
        self._maybe_reload()
        digest, found = _digest(presented), None
        for known, scope in self._table:  # no early exit: every token is compared
            if hmac.compare_digest(digest, known):
                found = scope
        return Principal(found, digest.hex()[:8]) if found else None

    def outbound(self, scope: str) -> Optional[str]:
        """A current token that passes `scope` checks, for this process's own calls to a peer
        sharing the tokens (the API asking `streamtune serve`); None when there is none."""
        self._maybe_reload()
        return self._outbound.get(scope) or self._outbound.get("admin")

    def configured(self) -> bool:
        self._maybe_reload()
        return bool(self._table)

    def count(self) -> dict[str, int]:
        """How many tokens each scope has (what logs may say about them)."""
        counts = {s: 0 for s in SCOPES}
        for _, scope in self._table:
            counts[scope] += 1
        return counts

    def summary(self) -> str:
        return ", ".join(f"{n} {s}" for s, n in self.count().items())


class AccessPolicy:
    """Decides each call from its Authorization header and the scope its route needs."""

    def __init__(self, tokens: TokenStore, host: str = "127.0.0.1", insecure: bool = False, service: str = "server"):
        self.tokens, self.host, self.insecure, self.service = tokens, host, insecure, service
        self.loopback = is_loopback(host)
        if not tokens.configured():
            if not self.loopback and not insecure:
                raise ConfigError(f"{service} binds {host}, beyond loopback, and no token is configured: set "
                                  "--tokens-file, STREAMTUNE_TOKENS_DIR or STREAMTUNE_TOKENS_<SCOPE> "
                                  "(or --insecure, for tests and demos only)")

    def announce(self) -> None:
        """Log at start what the policy is (counts of tokens, never their values)."""
        if self.tokens.configured():
            if self.insecure:
                log.warning("--insecure has no effect: tokens are configured and enforced")
            log.info("%s on %s: tokens required on every route but health checks (%s)", self.service, self.host,
                     self.tokens.summary())
        elif self.insecure:
            log.warning("INSECURE: %s on %s has no token and --insecure: ANYONE who can reach this address may "
                        "call EVERY route anonymously (read data, call inference, post feedback, change what is "
                        "trained and served). For tests and demos only.", self.service, self.host)
        else:
            log.warning("%s on loopback %s without tokens: anonymous callers may read and call inference; "
                        "nothing else is allowed until a token is configured", self.service, self.host)

    def anonymous_scopes(self) -> tuple[str, ...]:
        """What a caller without a token may do now (tokens may appear or vanish at a reload)."""
        if self.tokens.configured():
            return ()
        if self.insecure:
            return SCOPES
        return ("read", "inference") if self.loopback else ()

    def authorize(self, authorization: Optional[str], needed: str) -> Principal:
        """The caller if allowed; Unauthorized (401) or Forbidden (403) otherwise."""
        if needed == PUBLIC:
            return ANONYMOUS
        presented = None
        if authorization:
            scheme, _, value = authorization.strip().partition(" ")
            if scheme.lower() == "bearer" and value.strip():
                presented = value.strip()
        if presented is None:
            anonymous = self.anonymous_scopes()
            if "admin" in anonymous or needed in anonymous:
                return ANONYMOUS
            raise Unauthorized("missing or wrong bearer token")
        principal = self.tokens.scope_of(presented)
        if principal is None:
            raise Unauthorized("missing or wrong bearer token")
        if not allows(principal.scope, needed):
            extra = " (the feedback token is accepted by POST /v1/feedback only)" if principal.scope == "feedback" \
                else ""
            raise Forbidden(f"this {principal.scope} token cannot do that: it needs an {needed} token{extra}"
                            if needed[0] in "aeiou" else
                            f"this {principal.scope} token cannot do that: it needs a {needed} token{extra}")
        return principal


def client_token(scope: str, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A token a client may send for `scope`, from the same environment a server reads
    (STREAMTUNE_TOKENS_<SCOPE>, then admin's, then STREAMTUNE_API_TOKEN); None when none.

    >>> client_token("inference", {"STREAMTUNE_TOKENS_INFERENCE": "i-1,i-2"})
    'i-1'
    >>> client_token("read", {"STREAMTUNE_API_TOKEN": "adm"})
    'adm'
    """
    env = os.environ if env is None else env
    for var in (f"STREAMTUNE_TOKENS_{scope.upper()}", "STREAMTUNE_TOKENS_ADMIN"):
        tokens = [t.strip() for t in env.get(var, "").split(",") if t.strip()]
        if tokens:
            return tokens[0]
    if scope == "feedback" and env.get("STREAMTUNE_API_FEEDBACK_TOKEN"):
        return env["STREAMTUNE_API_FEEDBACK_TOKEN"]
    return env.get("STREAMTUNE_API_TOKEN") or None


def bearer_headers(scope: str, env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """{"Authorization": "Bearer T"} for `client_token(scope)`, or {} without one."""
    token = client_token(scope, env)
    return {"Authorization": f"Bearer {token}"} if token else {}


# ---------------------------------------------------------------- FastAPI / ASGI


class RequireScope:
    """A FastAPI dependency: the route needs `scope`; answers the caller's Principal.

    The middleware already decided; this re-checks (a router mounted without the middleware
    stays guarded) and hands the handler who called."""

    def __init__(self, scope: str):
        if scope not in SCOPES:
            raise ValueError(f"unknown scope {scope}")
        self.scope = scope

    def __call__(self, request: Request) -> Principal:
        return request.app.state.access.authorize(request.headers.get("authorization"), self.scope)


def route_scope(route) -> Optional[str]:
    """The scope a FastAPI route declares through RequireScope (searched in its dependencies)."""
    dependant = getattr(route, "dependant", None)
    stack = list(dependant.dependencies) if dependant is not None else []
    while stack:
        dep = stack.pop()
        if isinstance(dep.call, RequireScope):
            return dep.call.scope
        stack += dep.dependencies
    return None


def route_table(app, public_paths: Iterable[str], read_paths: Iterable[str] = ()) -> list[tuple[object, str]]:
    """(route, scope) for every route of `app`; ConfigError for a route that declares neither
    a scope nor a place in `public_paths` / `read_paths` (so no new route is left open)."""
    public, reads = set(public_paths), set(read_paths)
    table = []
    for route in _flat_routes(app):
        path = getattr(route, "path", None)
        scope = route_scope(route) or (PUBLIC if path in public else "read" if path in reads else None)
        if scope is None:
            raise ConfigError(f"route {path} declares no scope (Depends(RequireScope(...))) and is not public")
        table.append((route, scope))
    return table


def _flat_routes(app) -> list:
    """The app's routes with included routers flattened (FastAPI >= 0.16x includes them lazily)."""
    try:
        from fastapi.routing import _iter_included_route_candidates
    except ImportError:  # older FastAPI: included routes are copied into app.router.routes
        return list(app.router.routes)
    return list(_iter_included_route_candidates(app.router.routes))


class AuthMiddleware:
    """ASGI: every HTTP request is authorized for the scope of the route it matches before
    anything else runs (body read, validation, lookups). A path no route matches needs `read`.
    `reject(status, message)` builds the error response body (each server has its shape)."""

    def __init__(self, app, policy: AccessPolicy, table_of: Callable[[], list], reject: Callable[[int, str], dict]):
        self.app, self.policy, self.table_of, self.reject = app, policy, table_of, reject
        self._table = None

    def needed(self, scope) -> str:
        from starlette.routing import Match

        if self._table is None:
            self._table = self.table_of()
        partial = None
        for route, needed in self._table:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return needed
            if match == Match.PARTIAL and partial is None:
                partial = needed  # the path exists with another method: 405 once authorized
        return partial or "read"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = None
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        try:
            self.policy.authorize(header, self.needed(scope))
        except (Unauthorized, Forbidden) as e:
            import json

            body = json.dumps(self.reject(e.status, str(e))).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            if e.status == 401:
                headers.append((b"www-authenticate", b"Bearer"))
            await send({"type": "http.response.start", "status": e.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        return await self.app(scope, receive, send)
