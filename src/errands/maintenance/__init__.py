"""Leader-only duties: rescue expired leases, promote due jobs, prune old rows."""

from .service import Maintenance

__all__ = ["Maintenance"]
