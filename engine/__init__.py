"""rewind.engine. (Importing it imports rewind.kernels first: see there why, for Triton's interpreter.)"""

import rewind.kernels  # noqa: F401
