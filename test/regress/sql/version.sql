-- The C library and the SQL objects must come from the same release.
SELECT tuvl.version() = extversion AS library_matches_installed_version
FROM pg_extension WHERE extname = 'tuvl';
SELECT tuvl.version() = default_version AS library_matches_control_file
FROM pg_available_extensions WHERE name = 'tuvl';
-- The schema, the role and the tables exist.
SELECT count(*) = 1 AS operator_role_exists FROM pg_roles WHERE rolname = 'tuvl_operator';
SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'tuvl' AND c.relkind = 'r' ORDER BY 1;
