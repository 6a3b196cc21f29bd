"""Pipeline parallelism: schedules as data (schedules.py) and the simulator that checks them."""
