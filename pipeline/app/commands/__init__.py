"""The `compress` commands, one module each, loaded by name by the CLI's group (pipeline/app/cli.py COMMANDS) when
the command runs: each imports the machinery it runs at its top, and `compress --help` imports none of them. This
package's own module is light (click and the exit codes): every command imports it."""
from __future__ import annotations

from pipeline.base.errors import EXIT_CODES

EPILOG = "Exit codes: " + "; ".join(f"{k} {v}" for k, v in EXIT_CODES.items())
SET_HELP = "Override a recipe field, e.g. --set quantize.0.bits=3 (repeatable; type-checked)."
