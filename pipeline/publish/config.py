"""The recipe's `[publish]` table: where export folders go on the Hub, and when.

Torch-free on purpose: the recipe loader imports it before any weight is loaded.
The token is deliberately absent: it comes from HF_TOKEN or `hf auth login`.
"""
from __future__ import annotations

import re
import string
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

TOKEN_MESSAGE = (
    "the Hub token must come from HF_TOKEN or `huggingface-cli login`, never from a recipe"
)
_SECRET_KEY = re.compile(r"token|auth|secret|password|credential", re.IGNORECASE)

REPO_PLACEHOLDERS = frozenset({"org", "model", "variant"})
MESSAGE_PLACEHOLDERS = frozenset({"variant", "perplexity", "ppl_ratio", "run"})
DEFAULT_COMMIT_MESSAGE = "compress: {variant} (ppl {perplexity:.3f}, x{ppl_ratio:.4f} baseline)"


def template_fields(template: str) -> set[str]:
    """Names used as `{name}` / `{name:spec}` in a str.format template."""
    names = set()
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None:
            names.add(re.split(r"[.\[]", field, maxsplit=1)[0])
    return names


def _check_template(template: str, allowed: frozenset[str], what: str, sample: dict) -> str:
    try:
        used = template_fields(template)
        unknown = used - allowed
        if unknown:
            raise ValueError(
                f"{what} uses unknown placeholder(s) {sorted(unknown)}; allowed: {sorted(allowed)}"
            )
        if "" in used:
            raise ValueError(f"{what} has an empty placeholder '{{}}'; name it, e.g. {{variant}}")
        template.format(**sample)
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(f"{what} {template!r} is not a valid template: {err}") from None
    return template


LOOPBACK_HOSTS = ("localhost", "[::1]")


def summary(cfg: PublishConfig) -> str:
    """One line: where, how visible, and whether anything is sent (`compress check` and the dry run say it)."""
    visibility = "new repos private" if cfg.private else "new repos PUBLIC ([publish] private = false)"
    mode = "dry run: nothing is sent" if cfg.dry_run else "pushes when every gate passes" + (
        " (partial: the passing models)" if cfg.partial else "")
    where = cfg.repo_id + (f" ({cfg.layout})" if cfg.layout != "repo-per-variant" else "")
    return f"{where} for org {cfg.org}; {visibility}; {'pull requests; ' if cfg.create_pr else ''}{mode}"


def check_endpoint(url: str, what: str) -> str:
    """An https URL, or http only to this machine (the token travels with every request)."""
    m = re.match(r"(https?)://([^/\s]+)", url)
    if not m:
        raise ValueError(f"{what} {url!r} must be an http(s) URL, e.g. https://huggingface.co")
    scheme, host = m.groups()
    if "@" in host:
        raise ValueError(f"{what} must not carry credentials; {TOKEN_MESSAGE}")
    hostname = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
    if scheme == "http" and not (hostname in LOOPBACK_HOSTS or re.fullmatch(r"127(\.\d{1,3}){3}", hostname)):
        raise ValueError(f"{what} {url!r} is plain http to another machine: the Hub token would travel in "
                         "clear; use https (http is accepted only for 127.0.0.1/localhost)")
    return url.rstrip("/")


class PublishConfig(BaseModel, extra="forbid", hide_input_in_errors=True):
    """Where and how `compress` pushes export folders to the Hugging Face Hub."""

    org: str = Field(description="Hub user or organisation (letters, digits, -_.), {org} in repo_id")
    repo_id: str = Field("{org}/{model}-{variant}", description="target repo template: {org}, {model}, {variant}; "
                                                                "needs {variant} with repo-per-variant, must not have "
                                                                "it with branches")
    layout: Literal["repo-per-variant", "branches"] = Field(
        "repo-per-variant", description="repo-per-variant: a repo per export, at revision; branches: one repo, each "
                                        "export on a branch of its name")
    main_variant: str | None = Field(None, description="layout = branches: the export pushed to main instead of its "
                                                       "own branch; unset: none")
    draft: Literal["repo", "folder"] = Field(
        "repo", description="repo: the draft gets its own repo; folder: draft/ in its verifier's repo (refused for a "
                            "baseline verifier)")
    private: bool = Field(True, description="new repos are private; true also refuses pushing to an existing public "
                                            "repo; false: new repos are public")
    revision: str = Field("main", description="branch pushed to with repo-per-variant (created if missing); branches "
                                              "refuses any other value than main")
    # open a pull request instead of committing to the branch; reruns reuse the open PR that an
    # earlier push opened for the same folder (commit onto refs/pr/N, or "up to date")
    create_pr: bool = Field(False, description="open a pull request instead of committing to the branch; reruns reuse "
                                               "the PR opened for the same folder")
    commit_message: str = Field(DEFAULT_COMMIT_MESSAGE, description="template: {variant}, {perplexity}, {ppl_ratio} "
                                                                    "(a draft: its verifier's), {run}; format specs "
                                                                    "allowed; not empty")
    endpoint: str | None = Field(None, description="Hub URL: https, or http for 127.0.0.1/localhost only; unset: "
                                                   "$HF_ENDPOINT, else https://huggingface.co")
    dry_run: bool = Field(False, description="print which files would go where, with sizes; send nothing (no token "
                                             "needed)")
    partial: bool = Field(False, description="when gates failed, push the exports whose gates passed (a draft only "
                                             "with its verifier); false: push nothing")
    include: list[str] | None = Field(None, description="export names to push (distinct, not empty); unset: every "
                                                        "export the gates allow")

    @model_validator(mode="before")
    @classmethod
    def _no_token_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if isinstance(key, str) and _SECRET_KEY.search(key):
                    raise ValueError(f"[publish].{key}: {TOKEN_MESSAGE}")
        return data

    @field_validator("org")
    @classmethod
    def _org(cls, v: str) -> str:
        if not re.fullmatch(r"[\w.-]+", v):
            raise ValueError(f"org {v!r} must be a Hub user or organisation name (letters, digits, -_.)")
        return v

    @field_validator("repo_id")
    @classmethod
    def _repo_template(cls, v: str) -> str:
        sample = {"org": "org", "model": "model", "variant": "variant"}
        return _check_template(v, REPO_PLACEHOLDERS, "repo_id", sample)

    @field_validator("commit_message")
    @classmethod
    def _message_template(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("commit_message must not be empty")
        sample = {"variant": "v", "perplexity": 1.0, "ppl_ratio": 1.0, "run": "run"}
        return _check_template(v, MESSAGE_PLACEHOLDERS, "commit_message", sample)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is None:
            return v
        return check_endpoint(v, "endpoint")

    @field_validator("include")
    @classmethod
    def _include(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            if not v:
                raise ValueError("include = [] would push nothing; omit it to push every export")
            dupes = sorted({n for n in v if v.count(n) > 1})
            if dupes:
                raise ValueError(f"include lists {dupes} more than once")
        return v

    @model_validator(mode="after")
    def _layout_rules(self) -> PublishConfig:
        has_variant = "variant" in template_fields(self.repo_id)
        if self.layout == "repo-per-variant":
            if not has_variant:
                raise ValueError(
                    "layout 'repo-per-variant' needs {variant} in repo_id (one repo per variant); "
                    "for one repo with a branch per variant use layout = 'branches'"
                )
            if self.main_variant is not None:
                raise ValueError("main_variant only applies to layout = 'branches'")
        else:
            if has_variant:
                raise ValueError(
                    "layout 'branches' puts every variant in one repo: repo_id must not contain "
                    "{variant}, e.g. repo_id = '{org}/{model}-compressed'"
                )
            if "revision" in self.model_fields_set and self.revision != "main":
                raise ValueError(
                    "revision does not apply to layout 'branches': each variant's branch is "
                    "its name ('main' for main_variant)"
                )
        return self
