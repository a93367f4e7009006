"""nbmake runs the notebooks in kernels that inherit this environment: use their
small configuration (also when `pytest notebooks` is run without tests/)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KDP_NOTEBOOK_SMALL", "1")
