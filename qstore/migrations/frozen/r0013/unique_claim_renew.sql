## unique_claim_renew: the BEFORE UPDATE trigger function of job_unique_claims.
##
## A key is owned by its claim row's job unless job_unique_releases holds a row for the
## row's claim_id. Every update of a claim row is a new claim (a released key taken over
## by another job, or taken again by its own job), so the row gets a new claim_id here and
## the release of the claim before it no longer applies. Whoever writes the update (this
## release's takeover, or a previous release re-taking its own job's key) need not know.
##
## Template parameters: s (schema).
CREATE OR REPLACE FUNCTION ${s}.unique_claim_renew() RETURNS trigger LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  NEW.claim_id := nextval('${s}.job_unique_claim_seq'::regclass);
  RETURN NEW;
END
$$
