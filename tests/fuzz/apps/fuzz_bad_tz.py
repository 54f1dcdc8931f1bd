"""An app whose periodic job names a time zone that does not exist (fails at import)."""

from __future__ import annotations

import errands

app = errands.App()


@app.periodic("0 3 * * *", tz="Mars/Olympus_Mons", name="fuzz.nightly")
def nightly() -> None:
    pass
