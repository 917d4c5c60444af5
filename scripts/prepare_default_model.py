#!/usr/bin/env python3
"""Prepare the default model (SmolLM2-135M-Instruct) once. Options: --output DIR, --force, --quiet."""
import sys, pathlib
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # also works uninstalled
from prefix_service.prepare_model import main  # noqa: E402
sys.exit(main())
