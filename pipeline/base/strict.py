"""The recipe's pydantic base: an unknown key is an error, and so is an assignment of a wrong type (`--set`)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
