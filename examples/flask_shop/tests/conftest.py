from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ["SHOP_DB"] = str(Path(tempfile.mkdtemp(prefix="flask-shop-")) / "shop.db")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
