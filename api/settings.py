"""Service settings: where the store lives, how many solves at once, and the limits that protect the machine."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TOKEN_ENV = "MOSOS_API_TOKEN"


def default_db_path() -> Path:
    """The store lives in the user's data directory, so `mosos serve` needs no arguments."""
    import platformdirs

    return Path(platformdirs.user_data_dir("mosos", appauthor=False)) / "plans.sqlite3"


def default_solver_threads() -> int:
    return max(1, min(4, (os.cpu_count() or 1) // 2))


class Settings(BaseModel):
    """Everything configurable; the defaults suit a small machine."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    db_path: Path = Field(default_factory=default_db_path)
    solve_processes: int = Field(
        default=2, ge=1, le=1024, description="Solves that run at once: worker processes here, or Ray tasks with the ray backend."
    )
    backend: Literal["local", "ray"] = Field(
        default="local", description="Where solves run: local processes, or Ray tasks (the `ray` extra)."
    )
    ray_address: str | None = Field(
        default=None, description="Ray cluster to join with the ray backend; None: a local Ray on this machine."
    )
    request_processes: int = Field(
        default=2, ge=1, le=64, description="Processes that read, validate and simulate request bodies, so that the "
        "server's event loop (and status calls) never wait behind that work."
    )
    request_nice: int = Field(
        default=5, ge=0, le=19, description="Niceness of request processes: below the server, above the solves."
    )
    queue_size: int = Field(default=16, ge=0, description="Plans that may wait for a worker; beyond it, 429.")
    max_body_bytes: int = Field(default=16 * 2**20, ge=1024, description="Largest request body accepted.")
    max_nodes: int = Field(default=5000, ge=1, description="Most nodes a profile may have.")
    max_time_limit_s: float = Field(default=120.0, gt=0, description="Longest solver time limit a request may ask for.")
    default_time_limit_s: float = Field(default=30.0, gt=0)
    max_solver_workers: int = Field(default_factory=default_solver_threads, ge=1, description="Most solver threads per solve.")
    max_search_time_s: float = Field(default=600.0, gt=0, description="Longest time limit a max-batch search may ask "
                                     "for (the whole search; each of its solves is held to max_time_limit_s).")
    max_wait_s: float = Field(default=60.0, ge=0, description="Longest a POST may wait for its plan before answering 202.")
    default_wait_s: float = Field(default=5.0, ge=0)
    solver_nice: int = Field(
        default=10, ge=0, le=19, description="Niceness of solve processes: the server answers first, solves use what is left."
    )
    cancel_grace_s: float = Field(default=3.0, gt=0, description="How long a cancelled solve may take to stop before it is killed.")
    overrun_factor: float = Field(
        default=1.1, ge=1, description="A solve is killed after overrun_factor * its time limit + overrun_grace_s. "
        "plan() keeps one deadline for all its work (it returns within the limit + 5% + 1 s, measured in "
        "benchmarks/results/solver_scaling.md), so only a broken solve gets there."
    )
    overrun_grace_s: float = Field(
        default=5.0, gt=0, description="Beyond the limit: reading the profile, writing the answer, a loaded machine."
    )
    token: str | None = Field(default=None, repr=False, description="Bearer token; None: no authentication.")
    insecure: bool = False
    plugins: list[str] = Field(
        default_factory=list, description="Modules or .py files imported in every process, to register extra strategies."
    )

    @field_validator("token")
    @classmethod
    def _presentable(cls, token: str | None) -> str | None:
        problem = None if token is None else token_problem(token)
        if problem is not None:
            raise ValueError(f"the token {problem}")
        return token

    @model_validator(mode="after")
    def _local_processes_fit_a_machine(self) -> "Settings":
        if self.backend == "local" and self.solve_processes > 64:
            raise ValueError(f"solve_processes: {self.solve_processes} local solve processes is more than 64; "
                             "use the ray backend to solve more at once")
        return self

    def effective_default_time_limit_s(self) -> float:
        return min(self.default_time_limit_s, self.max_time_limit_s)

    def effective_default_wait_s(self) -> float:
        return min(self.default_wait_s, self.max_wait_s)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def token_problem(token: str) -> str | None:
    """Why no HTTP client could present this token, if it cannot: clients send it as UTF-8 bytes in a header."""
    try:
        token.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    for position, character in enumerate(token):
        if ord(character) < 0x20 or ord(character) == 0x7F:
            return f"contains a control character ({character!r} at position {position}), which no HTTP header can carry"
    return None


def read_token(token_file: Path | None) -> str | None:
    """The token file (UTF-8) wins over the environment; a blank environment variable means no token, but a blank
    token file is refused (asked for a token, the server would otherwise start open to anyone); a token no client
    could send is refused with the reason (ValueError), rather than starting a server nobody can call."""
    if token_file is not None:
        source = f"the token file {token_file}"
        try:
            token = token_file.read_bytes().decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ValueError(f"{source} is not valid UTF-8") from None
        if not token:
            raise ValueError(f"{source} is empty (or only whitespace): write the token in it, or leave "
                             "--token-file out to serve without one (on a loopback address only)")
    else:
        source = f"${TOKEN_ENV}"
        token = os.environ.get(TOKEN_ENV, "").strip()
    problem = token_problem(token)
    if problem is not None:
        raise ValueError(f"{source} {problem}")
    return token or None
