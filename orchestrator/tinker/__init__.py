"""The Tinker API on aspen's HTTP server: users' own training loops through the tinker SDK."""
