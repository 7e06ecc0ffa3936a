"""The job table (SQLite in the service's state folder): its rows, schema and migrations, backup, and the
state folder that holds it."""
