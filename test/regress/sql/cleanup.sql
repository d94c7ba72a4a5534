-- Drop the extension so its workers leave this database (DROP DATABASE then works).
DROP SCHEMA IF EXISTS shop, steps, perm CASCADE;
DROP EXTENSION tuvl;
DROP ROLE tuvl_alice;
DROP ROLE tuvl_bob;
