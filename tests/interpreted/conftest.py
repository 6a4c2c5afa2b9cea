import os

import pytest

# these tests need triton's CPU interpreter, chosen when triton is imported: the environment must ask for
# it before this process imported triton (tests/conftest.py collects this directory only then; a path
# given by hand is collected anyway, so it is refused here rather than run on the compiler)
if os.environ.get("TRITON_INTERPRET") != "1":
    raise pytest.UsageError("tests/interpreted runs under triton's CPU interpreter: "
                            "TRITON_INTERPRET=1 python -m pytest tests/interpreted")
