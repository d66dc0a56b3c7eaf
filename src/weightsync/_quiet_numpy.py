"""Silences torch's import-time warning about a missing numpy, and nothing else.

`import torch` warns when numpy is missing, though torch does not depend on it and neither
weightsync nor torch's CPU paths use it: on an install with torch alone, every `weightsync`
command and engine server would open with that warning. Imported by the package before torch.
"""

import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
