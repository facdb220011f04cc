-- streamtune's Python UDFs (udfs/) as SQL functions, for SQL clients that do not call
-- udfs.register_all (sql-client.sh; `streamtune sql` registers them itself). The udfs
-- package must be importable by the client and the Python workers: installed in their
-- Python (the compose image installs streamtune) or shipped as a zip holding udfs/
-- (`zip -r udfs.zip udfs; sql-client.sh -pyfs udfs.zip ...`; see sql/README.md).
-- Output: none (registers token_count, json_path, confidence, pseudo_label).
CREATE TEMPORARY SYSTEM FUNCTION IF NOT EXISTS token_count AS 'udfs.token_count.token_count' LANGUAGE PYTHON;
CREATE TEMPORARY SYSTEM FUNCTION IF NOT EXISTS json_path AS 'udfs.json_path.json_path' LANGUAGE PYTHON;
CREATE TEMPORARY SYSTEM FUNCTION IF NOT EXISTS confidence AS 'udfs.confidence.confidence' LANGUAGE PYTHON;
CREATE TEMPORARY SYSTEM FUNCTION IF NOT EXISTS pseudo_label AS 'udfs.pseudo_label.pseudo_label' LANGUAGE PYTHON;
