"""The fleet: partitioning work by site so one owner enforces each site's politeness."""
