"""What trainers report, taken in and booked into the job table, and who else hears what the service does."""
